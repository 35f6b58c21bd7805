"""`bench()`: plan, measure and finish one candidate against a base on this machine, and keep the
record under `profile/<op>-opt/runs/<stamp>-{bench,aa}/record.json`.

The record is written even when the run is cut short (Ctrl-C, a withdrawn verify), so that
`--json` can name it; a run whose workers never answered leaves no empty run directory.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from flaloop.bench import record as record_mod
from flaloop.bench.finish import finish
from flaloop.bench.measure import measure
from flaloop.bench.model import BenchConfig
from flaloop.bench.plan import MeasurePlan, base_ref, plan, working_tree
from flaloop.bench.record import RunRecord, TreeRef
from flaloop.bench.session import Cancelled, Events
from flaloop.core import clock, fsutil, git
from flaloop.core.errors import MeasurementError, StorageError
from flaloop.core.workspace import Workspace
from flaloop.guard.audit import audit
from flaloop.task.gate import last_gate_for


def triton_cache(ws: Workspace) -> Path:
    """Persistent under the workspace, shared by both sides and every run of the op
    (`$FLALOOP_TRITON_CACHE_DIR` overrides it)."""
    return Path(os.environ.get("FLALOOP_TRITON_CACHE_DIR") or ws.triton_cache)


def plan_working_tree(target, contract, *, base: str | None, shapes: list[str] | None, cfg: BenchConfig,
                      gate: dict | None, command: str) -> MeasurePlan:
    """The plan of `flaloop bench`: the working tree (snapshotted) against `base`, its static audit
    first (seconds, before any process starts)."""
    b = base_ref(target, contract, base)
    tree = git.tree_state(target.root)
    if cfg.aa:  # the base against itself; the record still says which checkout asked for it
        cand = TreeRef(commit=b.commit, ref="base (A/A)", head=tree["head"], dirty=tree["dirty"],
                       diff_hash=tree["diff_hash"], tree=b.tree)
    else:
        cand = working_tree(target, tree)
    static = None if cfg.aa else audit(target, contract, b.commit).to_dict()
    return plan(target, contract, base=b, candidate=cand, shapes=shapes, cfg=cfg, static=static, gate=gate,
                last_gate=(last_gate_for(target, contract.op, tree) or gated_by_loop(target, contract.op, tree))
                if gate is None else None, command=command)


def gated_by_loop(target, op: str, tree: dict) -> dict | None:
    """The gate a loop iteration ran on exactly this commit, clean: `iter` gates the working tree and
    then commits it, so the recorded gate's tree state (dirty, on the commit before) is not this one,
    though its code is."""
    from flaloop.core.errors import FlaloopError
    from flaloop.loop import store

    if tree.get("dirty") or not tree.get("head"):
        return None
    try:
        iters = store.iterations(target.workspace(op))
    except FlaloopError:
        return None
    it = next((i for i in reversed(iters) if i.commit == tree["head"] and i.gate), None)
    if it is None:
        return None
    g = it.gate
    return {"green": bool(g.get("green")), "signal_only": bool(g.get("signal_only")), "started": it.created,
            "counts": g.get("counts"), "k_expr": g.get("k_expr"), "reused_from": f"iteration {it.iter} of the loop"}


def run_plan(target, p: MeasurePlan, *, on_event: Events | None = None, gpu: str | None = None,
             cancel: threading.Event | None = None, run_dir: Path | None = None) -> RunRecord:
    """Measure a plan on this machine and keep its record (also of a run cut short, or one whose workers
    failed after they answered: then `exc.record_path` names it)."""
    ws = target.workspace(p.op)
    created = clock.now_stamp()
    # its own directory, even when another run of this op started within the same second
    run_dir = run_dir or fsutil.unique_dir(ws.runs, f"{created}-{p.label}")
    try:
        m = measure(p, repo=target.root, run_dir=run_dir, triton_cache=triton_cache(ws), gpu=gpu,
                    on_event=on_event, cancel=cancel)
    except (KeyboardInterrupt, Cancelled, MeasurementError) as exc:
        m = getattr(exc, "measurement", None)
        if m is not None and m.started:  # the workers answered: what they measured is kept
            if isinstance(exc, MeasurementError):
                m.errors.append(exc.message)
            else:
                m.interrupted = True
            rec = finish(p, m, created=created, gpu=gpu)
            with contextlib.suppress(StorageError):  # an interrupt outranks a record that could not be kept
                record_mod.write(run_dir, rec)
                exc.record_path = rec.path  # type: ignore[attr-defined]  # so that --json can name it
        else:
            _drop_empty(run_dir)
        raise
    except BaseException:
        _drop_empty(run_dir)
        raise
    rec = finish(p, m, created=created, gpu=gpu)
    if m.started:
        record_mod.write(run_dir, rec)
    else:
        _drop_empty(run_dir)
    return rec


def _drop_empty(run_dir: Path) -> None:
    with contextlib.suppress(OSError):
        run_dir.rmdir()  # nothing ran (a bad worktree, say): no empty run directory left


def bench(target, contract, *, base_ref: str | None, shapes: list[str] | None, cfg: BenchConfig,
          on_event: Events | None = None, gate: dict | None = None, command: str = "",
          gpu: str | None = None, cancel: threading.Event | None = None) -> RunRecord:
    """One paired session of the working tree against `base_ref` (default: the contract's base)."""
    p = plan_working_tree(target, contract, base=base_ref, shapes=shapes, cfg=cfg, gate=gate, command=command)
    return run_plan(target, p, on_event=on_event, gpu=gpu, cancel=cancel)
