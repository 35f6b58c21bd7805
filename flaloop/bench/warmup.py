"""The session's warm-up of each cell, in the warm-up pair (which then measures nothing).

For every cell, both sides before any timed sample: set up (build inputs, compile, autotune,
capture and prove the CUDA graph; the base calibrates k), the base's results finite (else the
inputs are outside the op's domain: refused), the candidate's equal to the base's (else blocked),
and the guard's probes on both sides, the mutation probe among them (docs/GUARD.md). Results
cross from base to candidate as CUDA IPC handles on a GPU, a file otherwise
(bench/worker/compare.py).

Functions of a `Session` (bench/session.py), which holds the workers and the state they use; a
test drives them over scripted fake workers (tests/test_session.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from flaloop.bench.analysis import tuning_differences
from flaloop.bench.model import CellResult
from flaloop.bench.workers import WorkerFailed
from flaloop.guard import dynamic
from flaloop.guard.findings import apply_allowances

if TYPE_CHECKING:
    from flaloop.bench.session import Session


def warm_all(s: Session) -> None:
    for i, res in enumerate(s.results):
        s.on_event("warm", cell=res.cell.id, index=i, total=len(s.results))
        try:
            warm_cell(s, res)
            if not s.broken:
                s.release(res)
        except WorkerFailed as exc:
            s.cell_failed(res, exc)
            if not s.restart(exc.message):
                return
        if s.broken and not s.restart(s.broken):
            return
        if s.blocked_run():
            return


def warm_cell(s: Session, res: CellResult) -> None:
    base = s.setup(res, "base", None, "auto")
    res.setup["base"] = base
    if not base.get("ok"):
        return s.fail(res, "base", base)
    nonfinite = {n: c for n, c in base.get("nonfinite", {}).items() if c}
    if nonfinite:
        res.status, res.reason = "refused", (
            "inputs outside the op's domain: the BASE gives non-finite values "
            + ", ".join(f"{n}: {c}" for n, c in nonfinite.items())
            + " (override an input transform in the contract, e.g. --input k=l2norm)")
        return None
    cand = s.setup(res, "cand", base["k"], "auto")
    res.setup["cand"] = cand
    if not cand.get("ok"):
        return s.fail(res, "cand", cand)
    res.tuning_differs = tuning_differences(base.get("tuning") or {}, cand.get("tuning") or {})
    if cand["timer"] != base["timer"]:  # both sides must be timed the same way
        why = cand.get("capture_error") or base.get("capture_error")
        base = s.setup(res, "base", base["k"], "eager")
        cand = s.setup(res, "cand", base["k"], "eager")
        res.setup.update(base=base, cand=cand, timer_note=f"one side could not be captured: {why}")
        if not (base.get("ok") and cand.get("ok")):
            return s.fail(res, "base" if not base.get("ok") else "cand", base if not base.get("ok") else cand)
    res.timer, res.k = base["timer"], base["k"]
    cmp_ = exchange(s, res, mutated=False)
    if cmp_ is None:
        return None
    res.diff = cmp_
    if not cmp_.get("match"):
        worst = sorted(cmp_.get("tensors", {}).items(), key=lambda kv: -(kv[1].get("rel_rms") or 0))[:3]
        res.status, res.reason = "blocked", (
            "candidate differs from base: " + ", ".join(
                f"{n} rel-RMS {t.get('rel_rms')}, non-finite {t.get('nonfinite_self')}" for n, t in worst))
        res.findings = [dynamic.finding("differs-from-base", res.reason, res.cell.id)]  # never allowable: it is wrong
        return None
    if s.cfg.probes:
        probe(s, res)
    return None


def exchange(s: Session, res: CellResult, mutated: bool) -> dict | None:
    """The base's results on set 0 (with `mutated`: on inputs changed in place) compared in the
    candidate with its own; None when a side failed (the cell is failed). On a GPU the results
    cross as CUDA IPC handles; where that is impossible, as a file in the run directory."""
    dump = s.run_dir / f"{'mutated' if mutated else 'dump'}-{s.results.index(res)}.pt"
    share = s.out.transfer["how"] == "cuda-ipc"
    try:
        d = s.ask("base", "dump", s.cfg.worker_timeout, cell=res.cell.id, path=str(dump), mutated=mutated, share=share)
        if not d.get("ok"):
            return s.fail(res, "base", d)
        if share and not d.get("shared"):
            s.out.transfer = {"how": "file", "why": d.get("share_error") or "the base could not share"}
        ref = {"shared": d["shared"]} if d.get("shared") else {"ref": str(dump)}
        c = s.ask("cand", "compare", s.cfg.worker_timeout, cell=res.cell.id, tol=s.cfg.diff_tol, mutated=mutated, **ref)
        if d.get("shared"):
            s.ask("base", "unshare", 120)
            if c.get("shared_error"):  # the candidate could not map the handles: the file, from now on
                s.out.transfer = {"how": "file", "why": f"the candidate could not map them: {c['shared_error']}"}
                return exchange(s, res, mutated)
    finally:
        dump.unlink(missing_ok=True)
    if not c.get("ok"):
        return s.fail(res, "cand", c)
    return c


def probe(s: Session, res: CellResult) -> None:
    t0 = time.monotonic()
    try:
        # one side after the other: each alone on the GPU, as the determinism probe must see it
        replies = {}
        for side in s.order():
            replies[side] = s.ask(side, "probe", s.cfg.worker_timeout, cell=res.cell.id)
            if not replies[side].get("ok"):
                return s.fail(res, side, replies[side])
        b, c = replies["base"], replies["cand"]
        mutated = exchange(s, res, mutated=True)
        if mutated is None:
            return None
    finally:
        s.out.probe_seconds += time.monotonic() - t0
    res.probes = {"base": b["probes"], "cand": c["probes"], "mutated": mutated,
                  "seconds": {"base": b.get("seconds"), "cand": c.get("seconds"), "mutated": mutated.get("seconds")}}
    found = dynamic.cell_findings(res.cell.id, b["probes"], c["probes"], mutated, s.cfg.diff_tol, aa=s.cfg.aa)
    res.findings = apply_allowances(found, s.allowed)
    blocking = sorted({f.rule for f in res.findings if f.blocking})
    if blocking:
        res.status, res.reason = "blocked", "guard: " + ", ".join(blocking)
    return None
