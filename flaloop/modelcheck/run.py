"""`check()`: the model check of the working tree (or a ref) against the contract's base, on this
machine, kept as `profile/<op>-opt/model/<stamp>-{model,aa}/record.json`.

The record holds both measurements: the step time (the bench's `CellResult` of the model cell:
every pair, the estimate and the verdict by the bench's own rules, analysis.analyse) with the op's
share of a step and what the op's speedup predicts for the step; and the trajectories (every run's
losses and gradient norms, the band, where the candidate left it). A trajectory that leaves the
band is a blocking finding (model-trajectory-left-band), and the step's verdict then reads BLOCKED.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

from flaloop.bench.analysis import analyse
from flaloop.bench.launcher import make_launcher
from flaloop.bench.measure import session_env
from flaloop.bench.model import BenchConfig, Cell
from flaloop.bench.plan import base_ref, tree_ref, working_tree
from flaloop.bench.record import TreeRef
from flaloop.bench.run import triton_cache
from flaloop.bench.session import Events
from flaloop.core import clock, fsutil, git
from flaloop.core.errors import MeasurementError, UsageError
from flaloop.core.workspace import Workspace, record_file
from flaloop.guard.findings import apply_allowances
from flaloop.modelcheck import band
from flaloop.modelcheck.session import ModelRefusal, ModelSession
from flaloop.modelcheck.spec import ModelSpec, resolve

SCHEMA = 1
CELL_ID = "model/step"


# A model step lasts tens to hundreds of milliseconds and its time moves by whole percents from
# one process to the next (issue 40: 0.83x-1.44x over four process pairs on the H200): fewer,
# longer samples than an op cell, and the same fresh-process rounds as the bench.
MODEL_DEFAULTS = {"min_pairs": 8, "max_pairs": 40, "cell_seconds": 120.0, "sample_ms": 200.0, "half_width": 0.005,
                  "margin": 0.01, "rounds": 2, "max_rounds": 4, "probes": False, "unseen_shapes": 0, "placements": 1}


def model_config(*, device: str, rounds: int | None, min_pairs: int | None, max_pairs: int | None,
                 margin: float | None, cell_seconds: float | None, sample_ms: float | None,
                 diff_tol: float | None, forkserver: bool, aa: bool, max_rounds: int | None = None) -> BenchConfig:
    given = {"rounds": rounds, "max_rounds": max_rounds, "min_pairs": min_pairs, "max_pairs": max_pairs,
             "cell_seconds": cell_seconds,
             "sample_ms": sample_ms, "diff_tol": diff_tol, "margin": None if margin is None else margin / 100}
    values = {**MODEL_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    return BenchConfig(**values, device=device, forkserver=forkserver, aa=aa).check()


def predicted_step_speedup(share: float | None, op_speedup: float | None) -> float | None:
    """Amdahl: a step whose op takes `share` of it, with the op `op_speedup` times faster. A share
    past 1 (the op's calls replayed alone read longer than the step, as noise can make them where
    the op is nearly the whole step) counts as the whole step."""
    if not share or not op_speedup or share <= 0 or op_speedup <= 0:
        return None
    share = min(share, 1.0)
    return 1.0 / ((1.0 - share) + share / op_speedup)


def model_cell(spec: ModelSpec) -> Cell:
    return Cell("model", {"B": spec.batch, "T": spec.seq_len, "model": spec.model_class}, "step", spec.dtype)


def check(target, contract, spec: ModelSpec, cfg: BenchConfig, *, base: str | None = None, aa: bool = False,
          op_speedup: float | None = None, on_event: Events | None = None, command: str = "",
          cancel: threading.Event | None = None, candidate_commit: str | None = None) -> dict:
    """One model check of the working tree (or `candidate_commit`: the go's kept iteration); the
    record (a dict, as written)."""
    b = base_ref(target, contract, base)
    if aa:
        cand = TreeRef(commit=b.commit, ref="base (A/A)", tree=b.tree)
    elif candidate_commit:
        cand = tree_ref(target.root, candidate_commit, candidate_commit)
    else:
        cand = working_tree(target)
    ws = target.workspace(contract.op)
    created = clock.now_stamp()
    run_dir = fsutil.unique_dir(ws.model, f"{created}-{'aa' if aa else 'model'}")
    perturb = spec.perturb if spec.perturb is not None else cfg.diff_tol
    cache = triton_cache(ws)
    t0 = time.monotonic()
    session = None
    refused = None
    with ExitStack() as stack:
        base_tree = stack.enter_context(git.worktree(target.root, b.commit, "base"))
        cand_tree = base_tree if aa else stack.enter_context(git.worktree(target.root, cand.commit, "cand"))
        env = session_env_for(cfg, cache)
        launcher = make_launcher(forkserver=cfg.forkserver, python=target.python, op=contract.op,
                                 registry=base_tree / target.registry_file.relative_to(target.root),
                                 device=cfg.device, env=env, import_mode=cfg.import_mode, gpu=None)
        stack.callback(launcher.close)
        session = ModelSession(spec=spec, perturb=perturb, op=contract.op, cells=[model_cell(spec)], config=cfg,
                               trees={"base": base_tree, "cand": cand_tree}, launcher=launcher, run_dir=run_dir,
                               triton_cache=cache, allowed=list(contract.allowed or []), on_event=on_event,
                               cancel=cancel, t0=t0)
        try:
            m = session.run()
        except ModelRefusal as exc:
            refused = str(exc)
            m = session.out
    rec = finish(contract.op, spec, cfg, session, m, b=b, cand=cand, aa=aa, perturb=perturb, op_speedup=op_speedup,
                 created=created, command=command, refused=refused)
    if not m.started:
        with contextlib.suppress(OSError):
            run_dir.rmdir()  # nothing ran: no empty run directory left
    else:
        rec["path"] = str(fsutil.atomic_write_json(record_file(run_dir), rec))
    if refused:
        raise UsageError(f"the model check of {contract.op} in {spec.model_class} is refused: {refused}",
                         "fix the model in the contract (\"model\": {...}) or with --set; `flaloop model "
                         f"{contract.op} --help` lists the fields")
    res = session.results[0]
    if res.status in ("failed", "refused") and not m.started:
        raise MeasurementError(f"the model check failed before any worker answered: {res.reason}")
    return rec


def session_env_for(cfg: BenchConfig, cache: Path) -> dict:
    class _P:  # session_env reads only the plan's config
        config = cfg
    return session_env(_P, cache)  # type: ignore[arg-type]


def finish(op: str, spec: ModelSpec, cfg: BenchConfig, session: ModelSession, m, *, b: TreeRef, cand: TreeRef,
           aa: bool, perturb: float, op_speedup: float | None, created: str, command: str,
           refused: str | None) -> dict:
    """The model record from a session (pure over what the session gathered)."""
    res = m.results[0]
    runs = session.model["trajectories"]
    judged = None
    found = []
    if {"base", "cand"} <= set(runs):
        perturbed = [r for name, r in runs.items() if name.startswith("band")]
        judged = band.judge(runs["base"], perturbed, runs["cand"], spec.band_scale)
        found = apply_allowances(band.findings(judged, CELL_ID, perturb, len(perturbed), spec.band_scale),
                                 list(session.allowed))
    summary = analyse(m.results, cfg.margin, cfg.seed, aa=aa, run_blocked=[f for f in found if f.blocking])
    share = session.model["opshare"]
    s_base = (share.get("base") or {}).get("share")
    replay = None
    if (share.get("base") or {}).get("op_ms") and (share.get("cand") or {}).get("op_ms"):
        replay = share["base"]["op_ms"] / share["cand"]["op_ms"]
    used = op_speedup or replay
    est = res.estimate
    return {
        "kind": "model", "schema": SCHEMA, "op": op, "created": created, "command": command, "aa": aa,
        "base": asdict(b), "candidate": asdict(cand), "model": spec.to_dict(), "config": cfg.to_dict(),
        "refused": refused,
        "step": {
            "verdict": res.verdict, "status": res.status, "reason": res.reason,
            "speedup": est.speedup if est else None, "ci_low": est.ci_low if est else None,
            "ci_high": est.ci_high if est else None,
            "base_ms": res.summary.base.median if res.summary.base else None,
            "cand_ms": res.summary.cand.median if res.summary.cand else None,
            "pairs": len(res.kept), "rounds": [asdict(r) for r in res.rounds],
            "op_share": s_base, "op_share_cand": (share.get("cand") or {}).get("share"),
            "op_speedup": used, "op_speedup_from": "--op-speedup" if op_speedup else ("replay" if replay else None),
            "predicted": predicted_step_speedup(s_base, used),
        },
        "opshare": share,
        "setup": session.model["setup"],
        "trajectory": {"steps": spec.steps, "perturb": perturb, "band_seeds": spec.band_seeds,
                       "band_scale": spec.band_scale, "runs": runs,
                       "judgement": judged.to_dict() if judged else None},
        # the trajectory's, then the step cell's own (the bench's timing cross-checks)
        "findings": [f.to_dict() for f in found + res.findings],
        "blocked": any(f.blocking for f in found + res.findings),
        "cell": res.to_dict(), "summary": summary.to_dict(),
        "errors": m.errors, "env": m.env, "timeline": m.timeline, "wall_s": m.wall_s, "host": m.host,
    }


def read(path: Path | str) -> dict:
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path} is not a readable model record: {exc}", "run `flaloop model OP` again") from exc
    if rec.get("kind") != "model":
        raise UsageError(f"{path} is not a model record", "pass a record written by `flaloop model`")
    return rec


def exit_code(rec: dict) -> int:
    """1 when the trajectory left the band, 3 when the step time could not be measured, else 0."""
    if rec.get("blocked"):
        return 1
    step = rec.get("step") or {}
    if rec.get("errors") or step.get("status") != "ok" or step.get("speedup") is None or not math.isfinite(step["speedup"]):
        return 3
    return 0


def named(contract) -> bool:
    """Whether the contract names a model check (`flaloop model OP --save`): `stop --go` runs it then."""
    m = getattr(contract, "model", None)
    return m is not None and not m.get("off")


def latest(ws: Workspace | Path, base_commit: str, cand_commit: str) -> dict | None:
    """The newest model record of `cand_commit` against `base_commit` that measured both sides (`ws`:
    the op's workspace, or its directory)."""
    for path in reversed(Workspace.of(ws).model_records()):
        try:
            rec = read(path)
        except UsageError:
            continue
        if (rec.get("base") or {}).get("commit") == base_commit and (rec.get("candidate") or {}).get("commit") == \
                cand_commit and not rec.get("aa") and not rec.get("refused"):
            rec.setdefault("path", str(path))
            return rec
    return None


def for_go(target, contract, iteration, *, on_event: Events | None = None, command: str = "") -> dict:
    """The model check a go rests on (when the contract names one): the kept iteration's commit
    against the contract's base; the recorded one when there is one, else a new one."""
    have = latest(target.workspace(contract.op), contract.base_commit, iteration.commit)
    if have is not None:
        return have
    spec = resolve(contract.op, contract.import_path, contract.model)
    cfg = model_config(device="auto", rounds=None, min_pairs=None, max_pairs=None, margin=None, cell_seconds=None,
                       sample_ms=None, diff_tol=None, forkserver=True, aa=False)
    return check(target, contract, spec, cfg, on_event=on_event, command=command, candidate_commit=iteration.commit)


def go_missing(rec: dict) -> list[tuple[str, str]]:
    """What the model check leaves missing for a go: a trajectory that left the band (or another
    blocking finding), or a step time that could not be measured. A SLOWER step is reported, not held
    against the go: the op's target is the op's."""
    where = f" ({rec.get('path')})"
    if rec.get("blocked"):
        return [("model", "; ".join(f["message"] for f in rec.get("findings") or [] if f.get("blocking")) + where)]
    if exit_code(rec) == 3:
        return [("model", f"the step time could not be measured: {(rec.get('step') or {}).get('reason')}" + where)]
    return []


def summary(rec: dict) -> dict:
    """What a report shows of a model record: the step, the share, the trajectories and their band
    (not the raw pairs, which stay in the record)."""
    tr = rec.get("trajectory") or {}
    return {"path": rec.get("path"), "model": rec.get("model"), "step": rec.get("step"), "created": rec.get("created"),
            "command": rec.get("command"), "blocked": rec.get("blocked"), "findings": rec.get("findings") or [],
            "trajectory": {k: tr.get(k) for k in ("steps", "perturb", "band_seeds", "band_scale", "judgement")}
            | {"base": (tr.get("runs") or {}).get("base"), "cand": (tr.get("runs") or {}).get("cand")}}


def rank_sweep(target, contract, rec, *, on_event: Events | None = None, say=None) -> None:
    """`sweep --rank-by model`: each measured candidate's model check against the sweep's base, one
    after another on this machine, then the rows ranked by the step's speedup. A trajectory that left
    the band blocks the row; a check that could not run leaves the row unranked, with the reason."""
    from flaloop.core.errors import FlaloopError

    spec = resolve(contract.op, contract.import_path, contract.model)
    cfg = model_config(device="auto", rounds=None, min_pairs=None, max_pairs=None, margin=None, cell_seconds=None,
                       sample_ms=None, diff_tol=None, forkserver=True, aa=False)
    for row in [r for r in rec.rows if r.status == "ok" and r.commit]:
        if say:
            say(f"model check of {row.ref} ...")
        try:
            m = check(target, contract, spec, cfg, base=rec.base.commit, candidate_commit=row.commit,
                      on_event=on_event, command=rec.command)
        except FlaloopError as exc:
            row.model = {"error": exc.message}
            continue
        st = m.get("step") or {}
        row.model = {k: st.get(k) for k in ("speedup", "ci_low", "ci_high", "verdict", "op_share", "predicted")}
        row.model.update(record=m.get("path"), blocked=m.get("blocked"))
        if m.get("blocked"):
            row.status, row.verdict = "blocked", "BLOCKED"
            row.reason = "; ".join(f["message"] for f in m.get("findings") or [] if f.get("blocking"))
    rec.rank_by = "model"
    rec.rank()
