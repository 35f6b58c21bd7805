"""Timed calls checked: in every round of every cell, one timed call, drawn at random, is compared
with the base's same call on the same inputs (docs/GUARD.md, timed-call-differs).

The warm-up's checks, the probes and the self-check each look at calls made outside the timed
samples; an op whose results go wrong only while it is timed (keyed on its call count, the
process's age, a graph capture, the timing loop, or the identity of the inputs it has seen) passes
them all. Here the checked call is one of the timed ones:

- Each round draws its own input values (`draw`: the run's salt and the round; the same on both
  sides, the cell's input transforms as before), so no result can be carried from the warm-up or
  an earlier round.
- The orchestrator draws which pair of the round and which of its k calls, and says so only in
  that sample's request: the worker copies that call's results as it returns (eager and CPU
  timers), or the graph's output tensors after that replay (graph timer). How many pairs a round
  takes is the stopping rule's to decide as it goes, so the pair is drawn as a reservoir of one
  (`replaces`): pair n replaces the kept call with probability 1/n, which leaves every pair of the
  round equally likely to be the one checked, the last as much as the first, for about ln(n) + 1
  copies a round, each after its own sample's events or as its call returns.
- Both sides keep the same call; the candidate's copy crosses to the base (CUDA IPC handles on a
  GPU, a file otherwise) and the base judges it within --diff-tol, and within what the cell dtype's
  arithmetic explains (`precision-narrowed`): nothing of the judging runs in the candidate's process.

Functions of the session's port (bench/port.SessionPort), called from bench/sampling.py.
"""

from __future__ import annotations

import random
import secrets
import time
from typing import TYPE_CHECKING

from flaloop.bench.model import CellResult
from flaloop.guard import dynamic
from flaloop.guard.findings import apply_allowances

if TYPE_CHECKING:
    from flaloop.bench.port import SessionPort

# Not the `random` module's shared generator: nothing the target runs can seed or read this one.
_RNG = random.SystemRandom()


def run_salt() -> str:
    """A run's salt for its rounds' input draws: unpredictable before the run, kept in the record."""
    return secrets.token_hex(6)


def draw(salt: str, rnd: int) -> str:
    """The input draw of round `rnd` (0-based) of a run: the same for both sides of the round."""
    return f"{salt}:r{rnd + 1}"


def replaces(taken: int) -> bool:
    """Whether the next pair's call replaces the kept one, `taken` pairs into the round (1/(taken+1))."""
    return _RNG.randrange(taken + 1) == 0


def call_index(k: int | None) -> int:
    """Which of a sample's k calls is kept (under the graph timer the worker keeps the replay's outputs)."""
    return _RNG.randrange(max(1, int(k or 1)))


def check(s: SessionPort, res: CellResult, at: dict) -> bool:
    """Compare the candidate's kept timed call with the base's (both kept by the sample request
    with `keep`); `at` says which (round, pair, call, k, timer, of_pairs). False when a side failed
    (the cell is failed) or the candidate differs (the cell is blocked)."""
    t0 = time.monotonic()
    try:
        c = _exchange(s, res)
    finally:
        seconds = time.monotonic() - t0
        out = s.out.timed_calls
        out["seconds"] = round(out.get("seconds", 0.0) + seconds, 4)
    if c is None:
        return False
    worst = dynamic.worst_tensor(c)
    entry = {**at, "match": bool(c.get("match")), "sets": c.get("sets"), "worst": worst,
             "seconds": round(seconds, 4)}
    res.probes.setdefault("timed_calls", []).append(entry)
    base_nonfinite = {n: t["nonfinite_ref"] for n, t in (c.get("tensors") or {}).items() if t.get("nonfinite_ref")}
    if base_nonfinite:  # this round's draw is outside the op's domain for the base itself: nothing to judge
        entry["skipped"] = "the base gives non-finite values: " + ", ".join(f"{n}: {k}" for n, k in base_nonfinite.items())
        out["skipped"] = out.get("skipped", 0) + 1
        return True
    out["checked"] = out.get("checked", 0) + 1
    if c.get("match"):
        # within --diff-tol, and yet more than the dtype's arithmetic explains: narrowed while timed
        narrowed = dynamic.precision_finding(res.cell.id, res.cell.dtype, c, aa=s.cfg.aa)
        if narrowed is None:
            return True
        entry["narrowed"] = narrowed.message
        (f,) = apply_allowances([narrowed], s.allowed)
        res.findings.append(f)
        if f.blocking:
            res.status, res.reason = "blocked", f"guard: {f.rule}"
            return False
        return True
    out["differ"] = out.get("differ", 0) + 1
    f = dynamic.timed_call_finding(res.cell.id, at, worst, c.get("tol"), aa=s.cfg.aa)
    (f,) = apply_allowances([f], s.allowed)
    res.findings.append(f)
    if f.blocking:
        res.status, res.reason = "blocked", f"guard: {f.rule}"
        return False
    return True


def _exchange(s: SessionPort, res: CellResult) -> dict | None:
    """The candidate's kept call to the base, judged there; None when a side failed."""
    dump = s.run_dir / f"timed-{s.results.index(res)}-r{s.round + 1}.pt"
    share = s.out.transfer.get("how") == "cuda-ipc"
    try:
        d = s.ask("cand", "dump", s.cfg.worker_timeout, cell=res.cell.id, path=str(dump), kept=True, share=share)
        if not d.get("ok"):
            return s.fail(res, "cand", d)
        ref = {"shared": d["shared"]} if d.get("shared") else {"ref": str(dump)}
        try:
            c = s.ask("base", "compare", s.cfg.worker_timeout, cell=res.cell.id, tol=s.cfg.diff_tol, kept=True, **ref)
        finally:
            if d.get("shared"):
                s.ask("cand", "unshare", 120)
        if c.get("shared_error"):  # the base could not map the handles: this once, the file
            d = s.ask("cand", "dump", s.cfg.worker_timeout, cell=res.cell.id, path=str(dump), kept=True)
            if not d.get("ok"):
                return s.fail(res, "cand", d)
            c = s.ask("base", "compare", s.cfg.worker_timeout, cell=res.cell.id, tol=s.cfg.diff_tol, kept=True,
                      ref=str(dump))
    finally:
        dump.unlink(missing_ok=True)
    if not c.get("ok"):
        return s.fail(res, "base", c)
    return c
