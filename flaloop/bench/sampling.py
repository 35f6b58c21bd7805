"""The session's paired sampling of one cell in one round's process pair.

Both sides set the cell up in the round's start order. A round is the mirror of the one before:
the side that sets up first also samples first, so the pairs run ABBA in even rounds and BAAB in
odd ones, and an effect of order falls on the base in one round and on the candidate in the next.
A settle pair comes first; the cell's setup record keeps it, outside the estimate. Then the
pairs, the GPU clock read around each (pairs below the clock floor or throttled are dropped),
until the stopping rule says so or the cell is settled beyond the margin in round 1; later rounds
take as many pairs as round 1 kept. Then a few eager samples (host launch cost) on both sides, in
the same mirrored order.

Why both: on the H200 the side that set up last and then sampled first read slow in that first
sample (in 31 of 40 such rounds of three verifies, by up to 2.7%), and it was always the base,
since round 2 set it up last and began with AB: a lean toward FASTER. A run of the graph just
before that sample did not help (docs/lab/2026-12-01-h200.md, R8 and R9).

Functions of the session's port (bench/port.SessionPort), which holds the workers and the state
they use; a test drives them over scripted fake workers (tests/unit/test_session.py).
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from flaloop.bench import timed
from flaloop.bench.analysis import settled
from flaloop.bench.evidence import ClockReading, throttle_names
from flaloop.bench.model import MIN_PAIRS_JUDGED, BenchConfig, CellResult, Pair
from flaloop.bench.workers import WorkerFailed
from flaloop.guard import dynamic
from flaloop.guard.findings import apply_allowances
from flaloop.stats.stopping import RuleFactory, StoppingRule

if TYPE_CHECKING:
    from flaloop.bench.port import SessionPort


def measure_cell(s: SessionPort, res: CellResult) -> None:
    """Sample one cell for this round. A crash or hang fails the cell; a fresh pair goes on."""
    t0 = time.monotonic()
    try:
        sample_cell(s, res, t0)
        if s.broken:
            s.restart(s.broken)
        else:
            s.release(res)
    except WorkerFailed as exc:
        s.cell_failed(res, exc)
        res.reason = f"round {s.round + 1}: {res.reason}"
        s.restart(exc.message)
    finally:
        res.seconds += time.monotonic() - t0


def setup_pair(s: SessionPort, res: CellResult, placements: int) -> bool:
    """Both sides set the cell up for this round's process pair, one after the other in the
    round's start order (the H200 once showed a setup-order offset: see BenchConfig.rounds);
    False when one failed. When the warm-up compiled (Session._fresh_pair) the first side
    calibrates k afresh: the warm-up process may have timed the op slower than the processes that
    measure it."""
    k = None if s.round == 0 and s.out.primed else res.k
    built = res.setup.setdefault("placements", [])
    for side in s.order():
        r = s.setup(res, side, k, "eager" if res.timer == "cuda_eager" else "auto", placements,
                    reference=s.cfg.probes, draw=timed.draw(s.out.timed_calls.get("draw", ""), s.round))
        if not r.get("ok"):
            s.fail(res, side, r)
            return False
        built.append({"round": s.round + 1, "side": side, "built": r.get("placements", 1),
                      "bytes": r.get("placement_bytes")})
        if k is None:
            res.setup["k_warmup"], res.k = res.k, r["k"]
            k = res.k
    return True


def round_budget(cfg: BenchConfig, rnd: int, first_round_kept: int,
                 make_rule: RuleFactory) -> tuple[int, int, StoppingRule]:
    """(min pairs, max pairs, stopping rule made by `make_rule`) of a cell in round `rnd` (0-based);
    the session's `stopping` is the factory (bench/session.Session picks the default).

    Each round takes its share of the pairs and time; the first round's target half-width is wider
    by sqrt(rounds), so that the pooled CI lands near the configured one. Later rounds take as
    many pairs as the first kept, so that every process pair weighs the same in the pooled
    estimate and a start-order offset cancels."""
    n_rounds = max(1, cfg.rounds)
    min_r = max(2, math.ceil(cfg.min_pairs / n_rounds))
    min_r += min_r % 2  # whole blocks of two pairs (ABBA, or BAAB in a mirrored round)
    max_r = max(min_r, math.ceil(cfg.max_pairs / n_rounds))
    if rnd and first_round_kept >= 2:
        min_r = max_r = first_round_kept
    rule = make_rule(target=cfg.half_width * math.sqrt(n_rounds), min_pairs=min_r, max_pairs=max_r,
                     max_seconds=cfg.cell_seconds / n_rounds)
    return min_r, max_r, rule


def sample_cell(s: SessionPort, res: CellResult, t0: float) -> None:
    cfg = s.cfg
    n_rounds = max(1, cfg.rounds)
    first = sum(p.round == 0 and p.dropped is None for p in res.pairs)
    min_r, max_r, rule = round_budget(cfg, s.round, first, s.stopping)
    # one block of two pairs per placement, so a round too short to reach a placement does not build it
    placements = max(1, min(cfg.placements, max_r // 2))
    if not setup_pair(s, res, placements):
        return None
    lead, other = s.order()  # the side that set up first samples first
    kept = None  # (pair, call) of the timed call to check against the base's (bench/timed.py)
    settle = pair(s, res, lead, 0)
    if settle is None:
        return None
    res.setup.setdefault("settle", []).append({"round": s.round + 1, "order": settle.order,
                                               "base_ms": settle.base_ms, "cand_ms": settle.cand_ms})
    mine: list[Pair] = []
    while True:
        if s.blocked_run():
            return None
        keep = timed.call_index(res.k) if cfg.probes and timed.replaces(len(mine)) else None
        p = pair(s, res, lead if len(mine) % 2 == 0 else other, (len(mine) // 2) % placements, keep)
        if p is None:
            return None
        res.pairs.append(p)
        mine.append(p)
        if keep is not None:
            kept = (len(mine) - 1, keep)
        r_kept = np.log(np.array([x.cand_ms / x.base_ms for x in mine if x.dropped is None]))
        s.on_event("pair", cell=res.cell.id, n=len(mine), kept=len(r_kept))
        # the time cap waits for a handful of pairs: a candidate far slower than the base (k is
        # calibrated on the base) must still get enough pairs to be called SLOWER, and the rounds
        # together the pairs a verdict needs (with --min-pairs 4 and one round, a loaded CPU's time
        # cap stopped a cell at 4 or 5 kept pairs, which then failed it)
        elapsed = time.monotonic() - t0 if len(r_kept) >= max(min(min_r, MIN_PAIRS_JUDGED),
                                                              math.ceil(MIN_PAIRS_JUDGED / n_rounds)) else 0.0
        done = rule.enough(r_kept, elapsed)
        # settled: judged on the stopping rule's own latest CI (no second bootstrap per pair)
        state = (settled(rule.last, cfg.margin, cfg.settle_band)
                 if not done and s.round == 0 and len(r_kept) >= min_r else None)
        if done or state or len(mine) >= 3 * max_r:
            why = (f"settled: the CI lies {state} the margin" if state else
                   f"{len(r_kept)} pairs, as many as round 1" if s.round and first >= 2
                   and (rule.reason or "").startswith("pair cap") else rule.reason)
            res.settled = state == "beyond"
            res.stop_reason = (res.stop_reason + "; " if res.stop_reason else "") + (
                f"round {s.round + 1}: {why}" if n_rounds > 1 else str(why))
            break
    if kept is not None and not timed.check(s, res, {"round": s.round + 1, "pair": kept[0], "call": kept[1],
                                                     "k": res.k, "timer": res.timer, "of_pairs": len(mine)}):
        return None
    for i in range(max(2, cfg.n_eager // n_rounds)):
        for side in (s.order() if i % 2 == 0 else s.order()[::-1]):
            r = s.ask(side, "eager", cfg.sample_timeout, cell=res.cell.id, n=1)
            if r.get("ok"):
                e = res.eager.setdefault(side, {"host_ms": [], "wall_ms": []})
                e["host_ms"] += r["host_ms"]
                e["wall_ms"] += r["wall_ms"]
    if s.cfg.probes:
        self_check(s, res)
    kept = sum(x.dropped is None for x in mine)
    if res.status == "blocked":
        return None
    if kept < 2:
        res.status = "failed"
        res.reason = f"round {s.round + 1}: " + too_few_pairs(mine)
    else:
        res.status = "ok"  # for now: the pooled count is judged after the last round
    return None


def self_check(s: SessionPort, res: CellResult) -> None:
    """Each side of this round's pair, after its samples, against what it computed at setup (the
    graph's outputs after one more replay, one more eager call, inputs changed in place). The
    warm-up's checks ran in another process and after a few calls; a candidate whose results
    change once it has been called many times, or has lived long, or has been captured, shows
    here. The candidate's change blocks the cell; one the base shows too is reported, not blocking
    (an op whose results vary from call to call beyond the tolerance on both sides)."""
    t0 = time.monotonic()
    replies = s.ask_both("selfcheck", s.cfg.worker_timeout,
                         {side: {"cell": res.cell.id, "tol": s.cfg.diff_tol} for side in s.order()})
    s.out.probe_seconds += time.monotonic() - t0
    for side, r in replies.items():
        if not r.get("ok"):
            return s.fail(res, side, r)
    res.probes.setdefault("self_check", []).append(
        {"round": s.round + 1, **{side: {k: r.get(k) for k in ("match", "checks", "seconds")}
                                  for side, r in replies.items()}})
    changed = {side: [name for name, c in (r.get("checks") or {}).items() if c.get("match") is False]
               for side, r in replies.items()}
    if not changed.get("cand"):
        return None
    f = dynamic.self_check_finding(res.cell.id, s.round + 1, changed["cand"], replies["cand"]["checks"],
                                   pre_existing=bool(changed.get("base")))
    (f,) = apply_allowances([f], s.allowed)
    res.findings.append(f)
    if f.blocking:
        res.status, res.reason = "blocked", f"guard: {f.rule}"
    return None


def pair(s: SessionPort, res: CellResult, lead: str, placement: int, keep: int | None = None) -> Pair | None:
    """One pair on a placement, `lead` sampling first; with `keep`, both sides keep the results of
    that call of their sample (bench/timed.py). None when a side failed (the cell is failed)."""
    before = s.clock()
    t, wall, rtt, told = {}, {}, {}, {}
    extra = {} if keep is None else {"keep": keep}
    for side in (lead, "cand" if lead == "base" else "base"):
        r = s.ask(side, "sample", s.cfg.sample_timeout, cell=res.cell.id, n=1, placement=placement, **extra)
        times = r.get("times_ms") or [None]
        if not r.get("ok") or times[0] is None or not times[0] > 0:
            return s.fail(res, side, r if not r.get("ok") else {"error": f"unusable time {times[0]!r} ms"})
        t[side] = times[0]
        wall[side] = (r.get("wall_ms") or [None])[0]
        rtt[side], told[side] = host_timed(s, side, r)
        if keep is not None:  # the kept copy's cost (bench/timed.py) is the check's
            s.out.timed_calls["seconds"] = round(s.out.timed_calls.get("seconds", 0.0) + (r.get("keep_s") or 0.0), 4)
    after = s.clock()
    occ = s.occupancy()
    foreign = [o["pid"] for o in occ["foreign"]] if occ and occ["visible"] else None
    dropped = drop_reason(s.cfg, before, after)
    if dropped is None and foreign and s.cfg.exclusive:  # --exclusive keeps only pairs the GPU was ours for
        dropped = "another process on the GPU: pid " + ", ".join(map(str, foreign))
    return Pair("AB" if lead == "base" else "BA", t["base"], t["cand"], before and before.to_dict(),
                after and after.to_dict(), dropped, round=s.round,
                base_wall_ms=wall["base"], cand_wall_ms=wall["cand"], placement=placement, foreign=foreign,
                base_rtt_ms=rtt["base"], cand_rtt_ms=rtt["cand"], base_reported_ms=told["base"],
                cand_reported_ms=told["cand"])


def host_timed(s: SessionPort, side: str, reply: dict) -> tuple[float | None, float | None]:
    """(round trip ms, reported ms) of one side's one-sample reply: the request's round trip on the
    orchestrator's clock (`WorkerClient.round_trip_s`), and what the worker says its work in it took
    (per-call ms times k). A timer forged inside the worker, however low,
    shrinks the second and not the first (guard/timing.timer_host_gap)."""
    rt = getattr(s.workers.get(side), "round_trip_s", None)
    k, times = reply.get("k"), reply.get("times_ms") or []
    # a sample that kept a call also copied it outside its timed window: both sides copy the same
    # call's results in the same pair, so the copy sits in both gaps, as the overhead does
    if rt is None or not k or len(times) != 1 or times[0] is None:
        return None, None
    return round(rt * 1e3, 4), round(float(times[0]) * int(k), 4)


def drop_reason(cfg: BenchConfig, before: ClockReading | None, after: ClockReading | None) -> str | None:
    for r in (before, after):
        if r is None:
            continue
        if r.throttled:
            return f"throttled: {', '.join(throttle_names(r.throttle_reasons))} (0x{r.throttle_reasons:x})"
        if r.fraction_of_max < cfg.clock_floor:
            return f"SM clock {r.sm_mhz} MHz < {cfg.clock_floor:.0%} of {r.sm_max_mhz}"
    return None


def too_few_pairs(pairs: list[Pair]) -> str:
    """Why a cell kept too few pairs to judge: what dropped the others, by kind with an example of
    each (a power-capped GPU drops every pair as throttled), and who else was on the GPU, with what
    to do about it."""
    kept = sum(p.dropped is None for p in pairs)
    kinds = Counter(re.sub(r"\d+", "N", p.dropped) for p in pairs if p.dropped)
    example = {re.sub(r"\d+", "N", p.dropped): p.dropped for p in reversed(pairs) if p.dropped}
    why = "; ".join(f"{n} {example[k]}" for k, n in kinds.most_common())
    text = f"only {kept} usable pairs ({len(pairs) - kept} dropped" + (f": {why})" if why else ")")
    shared = [p for p in pairs if p.foreign]
    if shared:
        pids = sorted({pid for p in shared for pid in p.foreign})
        text += (f"; another process was on the GPU in {len(shared)} of {len(pairs)} pairs (pid "
                 f"{', '.join(map(str, pids))}): measure when it has finished, or pass --exclusive to wait for it")
    return text
