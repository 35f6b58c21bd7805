"""`flaloop sweep`: many candidates of one op, or every op a change touches, each gated and
measured against one base, in parallel over the devices an executor has.

    plan      (here)           resolve the candidates, the static audit of each, its MeasurePlan
    measure   (an executor)    per candidate on one device: the full gate, then the paired session
    finish    (here)           each result into a run record, the rows ranked, sweep.json/.md/.png

A sweep never commits, never touches the working tree, the index or the branch: every candidate
is a commit checked out as a worktree (sweep/candidates.py). Its results are a signal; promotion
goes through `flaloop iter OP --from-sweep SWEEP REF`, one change per iteration.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from flaloop.bench import record as record_mod
from flaloop.bench.finish import finish
from flaloop.bench.measurement import Measurement
from flaloop.bench.model import BenchConfig
from flaloop.bench.plan import MeasurePlan, plan
from flaloop.bench.record import RunRecord, TreeRef
from flaloop.core import clock, fsutil, git
from flaloop.core.workspace import shared_sweeps
from flaloop.guard.audit import audit
from flaloop.loop import rules
from flaloop.report.plots import sweep_plot
from flaloop.report.sweep import render_markdown
from flaloop.sweep import record as sweep_record
from flaloop.sweep.candidates import Candidate
from flaloop.sweep.executors import Executor
from flaloop.sweep.job import Job, JobResult
from flaloop.sweep.record import SweepRecord, SweepRow
from flaloop.task.contract import Contract


@dataclass
class Entry:
    """One row of a sweep while it runs: an op's contract and one candidate of it."""

    contract: Contract
    candidate: Candidate
    row: SweepRow
    plan: MeasurePlan | None = None
    job: Job | None = None

    @classmethod
    def of(cls, contract: Contract, c: Candidate) -> Entry:
        return cls(contract=contract, candidate=c, row=SweepRow(key=c.key, op=contract.op, ref=c.ref, kind=c.kind,
                                                               commit=c.commit, tree=c.tree))


def sweeps_dir(target, op: str | None) -> Path:
    """Where a sweep is kept: under its op's workspace, or `profile/sweeps/` for several ops."""
    return target.workspace(op).sweeps if op else shared_sweeps(target.root)


def _static(target, contract: Contract, cand: Candidate, base: TreeRef) -> dict:
    with git.worktree(target.root, cand.commit, "cand") as wt:
        return audit(target.tree(wt), contract, base.commit).to_dict()


def _seed(target, contract: Contract, commit: str) -> dict:
    """The gate files the orchestrator has that a job's gate can reuse: the base's collected ids, and
    green gates of exactly this commit (the gate itself decides whether they still apply)."""
    ws = target.workspace(contract.op)
    out = {}
    for p in ws.gate_baselines(contract.base_commit):
        doc = fsutil.read_json_cache(p)
        if isinstance(doc, dict):
            out[ws.rel(p)] = doc
    for p in ws.gate_greens():
        doc = fsutil.read_json_cache(p)
        tree = (doc or {}).get("tree") or {} if isinstance(doc, dict) else {}
        if tree.get("head") == commit and not tree.get("dirty"):
            out[ws.rel(p)] = doc
    return out


def prepare(target, entries: list[Entry], base: TreeRef, *, cfg: BenchConfig, shapes: list[str] | None,
            regate: bool, gate_workers: int | None, command: str,
            say: Callable[[str], None] = lambda m: None) -> list[Job]:
    """The static audit of every valid candidate, then a job for each one it does not block."""
    jobs = []
    for e in entries:
        c, row = e.candidate, e.row
        if c.invalid:
            row.status, row.verdict, row.reason, row.invalid = "failed", "FAILED", c.invalid, True
            continue
        static = _static(target, e.contract, c, base)
        blocking = [f for f in static["findings"] if f.get("blocking")]
        row.guard = {"blocked": bool(blocking), "rules": sorted({f["rule"] for f in blocking}),
                     "static_findings": len(static["findings"])}
        if blocking:
            row.status, row.verdict = "blocked", "BLOCKED"
            row.reason = "guard: " + "; ".join(f"{f['rule']} at {f.get('where') or '-'}" for f in blocking[:3])
            say(f"{row.ref}: blocked by the guard's static rules ({', '.join(row.guard['rules'])}): not gated, not measured")
            continue
        e.plan = plan(target, e.contract, base=base, candidate=c.tree_ref(), shapes=shapes, cfg=copy.deepcopy(cfg),
                      static=static, command=command, label=c.key)
        e.job = Job(key=c.key, ref=c.ref, plan=e.plan.to_dict(), contract=e.contract.to_dict(), config=target.config,
                    regate=regate, gate_workers=gate_workers, seed=_seed(target, e.contract, c.commit))
        jobs.append(e.job)
    return jobs


def _gate_summary(g: dict | None) -> dict | None:
    if g is None:
        return None
    return {"green": bool(g.get("green")), "counts": g.get("counts"), "reused_from": g.get("reused_from"),
            "log_path": g.get("log_path"), "wall_s": round(g.get("wall_s") or 0.0, 2),
            "reasons": [f"{f['kind']}: {f['message']}" for f in g.get("findings") or []][:5]}


def finish_row(e: Entry, result: JobResult, sweep_dir: Path, margin: float) -> RunRecord | None:
    """A job's result into its row (and its run record, kept in the sweep's directory)."""
    row = e.row
    row.gate, row.host, row.gpu = _gate_summary(result.gate), result.host, result.gpu
    row.wall_s, row.attempts = result.wall_s, 1 + len(result.attempts)
    row.status, row.reason = result.status, result.reason
    if result.attempts:
        row.reason = (row.reason + "; " if row.reason else "") + "retried after: " + "; ".join(
            f"{a.get('host') or '?'}: {a.get('why')}" for a in result.attempts)
    rec = None
    if result.measurement is not None:
        m = Measurement.from_dict(result.measurement)
        if m.started:
            e.plan.gate = result.gate
            rec = finish(e.plan, m, created=clock.now_stamp(), gpu=result.gpu)
            record_mod.write(sweep_dir / row.key, rec)
            row.record = str(Path(rec.path).relative_to(sweep_dir))
            _from_record(row, rec, result, margin)
    if row.status != "ok":
        row.verdict = row.status.upper()
    return rec


def _from_record(row: SweepRow, rec: RunRecord, result: JobResult, margin: float) -> None:
    s = rec.summary
    row.cells = [{"id": c.id, "speedup": c.estimate.speedup if c.estimate else None,
                  "ci_low": c.estimate.ci_low if c.estimate else None,
                  "ci_high": c.estimate.ci_high if c.estimate else None, "verdict": c.verdict, "reason": c.reason}
                 for c in rec.cells]
    row.slower = [c.id for c in rec.cells if c.verdict == "SLOWER"]
    measured = [c for c in row.cells if c["speedup"] is not None]
    if measured:
        w = min(measured, key=lambda c: c["speedup"])
        row.worst_cell = {"id": w["id"], "speedup": w["speedup"], "verdict": w["verdict"]}
    row.geomean = asdict(s.geomean) if s.geomean else None
    if result.status != "ok":
        return
    if rec.guard.blocked or s.n_blocked:
        rules_ = sorted({f.rule for f in rec.guard.findings if f.blocking})
        cell = next((c for c in rec.cells if c.verdict == "BLOCKED"), None)
        row.status = "blocked"
        row.reason = "guard: " + (", ".join(rules_) or (cell.reason if cell else "a cell was blocked"))
    elif s.n_measured < s.n_cells or rec.errors or rec.interrupted:
        bad = [f"{c.id}: {c.reason or c.status}" for c in rec.cells if c.status != "ok"]
        row.status = "failed"
        row.reason = "; ".join(bad[:3] + rec.errors[:1]) or "not every cell was measured"
    else:
        row.status = "ok"
        row.verdict = rules.geomean_verdict(row.geomean, margin)


def run(target, *, kind: str, entries: list[Entry], base: TreeRef, cfg: BenchConfig, shapes: list[str] | None,
        executor: Executor, sweep_dir: Path, regate: bool = False, gate_workers: int | None = None,
        command: str = "", on_event: Callable[..., None] = lambda *a, **k: None,
        say: Callable[[str], None] = lambda m: None) -> SweepRecord:
    """Plan, measure on the executor, finish; the record is kept however the sweep ends (Ctrl-C too)."""
    t0 = time.monotonic()
    rec = SweepRecord(kind=kind, created=clock.now_stamp(), base=base,
                      ops=sorted({e.contract.op for e in entries}), rows=[e.row for e in entries],
                      executor=executor.describe(), config=cfg.to_dict(), command=command, margin=cfg.margin)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    by_key = {e.row.key: e for e in entries}
    stopped: BaseException | None = None
    finished: set[str] = set()
    try:
        jobs = prepare(target, entries, base, cfg=cfg, shapes=shapes, regate=regate,
                       gate_workers=gate_workers, command=command, say=say)
        for result in executor.run(jobs, on_event):
            e = by_key[result.key]
            finish_row(e, result, sweep_dir, cfg.margin)
            finished.add(result.key)
            on_event("done", key=result.key, status=e.row.status, verdict=e.row.verdict)
    except (KeyboardInterrupt, SystemExit) as exc:
        rec.interrupted, stopped = True, exc
        raise
    finally:
        for e in entries:  # a job that gave no result: withdrawn, or the sweep ended another way first
            if e.job is not None and e.row.key not in finished:
                e.row.status, e.row.verdict = "failed", "FAILED"
                e.row.reason = "withdrawn (interrupted)" if rec.interrupted else "no result (the sweep ended first)"
        rec.rank()
        rec.wall_s = round(time.monotonic() - t0, 2)
        save(sweep_dir, rec)
        if stopped is not None:
            stopped.record_path = rec.path  # type: ignore[attr-defined]  # so that --json can name it
        else:
            try:
                sweep_plot(rec, sweep_dir / "sweep.png")
            except Exception as exc:  # noqa: BLE001 - a plot that cannot be drawn costs the plot, never the record
                say(f"no plot: {type(exc).__name__}: {exc}")
    return rec


def save(sweep_dir: Path, rec: SweepRecord) -> Path:
    """sweep.json, and sweep.md drawn from it."""
    path = sweep_record.write(sweep_dir, rec)
    fsutil.atomic_write_text(sweep_dir / "sweep.md", render_markdown(rec))
    return path


def exit_code(rec: SweepRecord) -> int:
    """0 every candidate judged (ok or blocked); 2 a candidate was bad input (an unknown ref, a
    patch that does not apply, a duplicate, the base itself); 3 a candidate could not be measured.
    For an ops check (kind "ops"), 1 when an op is SLOWER beyond the margin on any cell or blocked."""
    rows = rec.rows
    if rec.kind == "ops" and any(r.status == "blocked" or r.slower or r.verdict == "SLOWER" for r in rows):
        return 1
    if any(r.invalid for r in rows):
        return 2
    if any(r.status == "failed" for r in rows):
        return 3
    return 0
