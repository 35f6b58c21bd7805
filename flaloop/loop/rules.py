"""The loop's rules, as pure functions of records: statuses, best, stall, stop and no-go.

Nothing here measures, reads git or touches a file; every decision the loop makes is a
function of the iteration records (store.Iteration), the decisions and the run records, so
each rule is tested over fake records and the CLI only gathers inputs and prints.

Statuses of an iteration (docs/LOOP.md):
  keep    the full gate is green, the guard has nothing blocking, every cell was measured, and
          the geomean speedup against the best kept iteration is FASTER beyond the margin (its
          whole CI above 1 + margin) with no cell SLOWER
  revert  the geomean or any cell is SLOWER than the best
  noise   neither: SAME or UNSURE
  drop    the gate is red, the guard blocked, or the bench could not measure every cell
  signal  a quick iteration (`--gate-k`, or a subset of the contract's shapes or modes): logged,
          never `keep`, not reverted, and not counted by the stall rule
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from flaloop import stats
from flaloop.bench.model import l2_states
from flaloop.loop.store import Decision, DispatchRow, Iteration
from flaloop.report import fmt

STALL_LIMIT = 3  # consecutive non-keep iterations before `iter` refuses until `reassess`
MIN_DIRECTIONS = 3  # distinct directions tried with evidence: a stop condition
NO_GO_ITEMS = ("baseline", "candidate attempt", "gate status", "bench evidence", "named bound")
MEASURED = ("FASTER", "SLOWER", "SAME", "UNSURE")


# -- one bench, summarized ----------------------------------------------------------------------

@dataclass(frozen=True)
class _Interval:
    ci_low: float
    ci_high: float


def geomean_verdict(geomean: dict | None, margin: float) -> str | None:
    """The single-cell CI rule (stats.verdict) applied to the geomean's joint CI."""
    if not geomean:
        return None
    return stats.verdict(_Interval(geomean["ci_low"], geomean["ci_high"]), margin).value


def compare(record, record_path: str | None) -> dict:
    """A bench run record (bench/record.RunRecord) reduced to what an iteration keeps: the geomean,
    its verdict, per-cell speedups and verdicts, and whether every cell was measured and none blocked."""
    margin = record.config.margin
    geo = asdict(record.summary.geomean) if record.summary.geomean else None
    cells = []
    for c in record.cells:
        est, summ = c.estimate, c.summary
        cells.append({"id": c.id, "speedup": est.speedup if est else None, "ci_low": est.ci_low if est else None,
                      "ci_high": est.ci_high if est else None, "verdict": c.verdict, "reason": c.reason,
                      "base_ms": summ.base.median if summ.base else None,
                      "cand_ms": summ.cand.median if summ.cand else None})
    blocked = record.guard.blocked or any(c["verdict"] == "BLOCKED" for c in cells)
    complete = bool(cells) and all(c["verdict"] in MEASURED for c in cells) and not record.errors \
        and not record.interrupted
    return {
        "record": record_path, "base_commit": record.base.commit,
        "geomean": geo, "verdict": geomean_verdict(geo, margin), "cells": cells, "margin": margin,
        "shapes": sorted({c.cell.shape_name for c in record.cells}),
        "modes": sorted({c.cell.mode for c in record.cells}),
        "varlen": [c.id for c in record.cells if c.cell.seqlens and c.verdict in MEASURED],
        "l2": sorted({c.cell.l2 for c in record.cells if c.verdict in MEASURED}),
        "blocked": blocked, "complete": complete, "errors": list(record.errors),
        "guard_findings": [f.to_dict() for f in record.guard.findings],
    }


def covers(cmp: dict | None, shapes: list[str], modes: list[str]) -> bool:
    """Whether a comparison measured every shape and mode of the contract."""
    return bool(cmp) and set(shapes) <= set(cmp["shapes"]) and set(modes) <= set(cmp["modes"])


# -- the status of an iteration -----------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    status: str
    reason: str


def decide(*, gate: dict | None, guard_blocked: bool, guard_reason: str, vs_best: dict | None,
           signal: bool) -> Outcome:
    """The status of one iteration from its gate, its guard and its bench against the best."""
    if not gate or not gate.get("green"):
        reasons = "; ".join((gate or {}).get("reasons") or []) or "no gate result"
        return Outcome("drop", f"gate red: {reasons}")
    if guard_blocked:
        return Outcome("drop", f"guard blocked: {guard_reason}")
    if vs_best is None:
        return Outcome("drop", "not benchmarked")
    if vs_best["blocked"]:
        cells = [f"{c['id']}: {c['reason']}" for c in vs_best["cells"] if c["verdict"] == "BLOCKED"]
        return Outcome("drop", "guard blocked: " + ("; ".join(cells) or "a bench probe blocked the run"))
    if not vs_best["complete"]:
        bad = [f"{c['id']} {c['verdict']}" for c in vs_best["cells"] if c["verdict"] not in MEASURED]
        why = "; ".join(bad + vs_best["errors"][:1]) or "nothing measured"
        return Outcome("drop", f"the bench could not measure every cell ({why})")
    verdict, margin = vs_best["verdict"], vs_best.get("margin", 0.005)
    slower = [c["id"] for c in vs_best["cells"] if c["verdict"] == "SLOWER"]
    if signal:
        return Outcome("signal", f"{verdict} vs best, signal only: never keep, not reverted")
    if verdict == "SLOWER" or slower:
        where = f"SLOWER on {', '.join(slower)}" if slower else "the geomean is SLOWER"
        return Outcome("revert", f"{where} than the best")
    if verdict == "FASTER":
        return Outcome("keep", f"geomean CI above {1 + margin:g}, no cell SLOWER")
    return Outcome("noise", f"{verdict} vs best: not beyond the {margin:.1%} margin")


# -- the loop's state ---------------------------------------------------------------------------

def baseline_of(iters: list[Iteration]) -> Iteration | None:
    return next((i for i in iters if i.iter == 0 and i.status == "baseline"), None)


def attempts(iters: list[Iteration]) -> list[Iteration]:
    return [i for i in iters if i.iter > 0]


def best(iters: list[Iteration]) -> Iteration | None:
    """The last kept iteration, else the baseline (each keep is faster than the best before it)."""
    keeps = [i for i in iters if i.status == "keep"]
    return keeps[-1] if keeps else baseline_of(iters)


def next_number(iters: list[Iteration]) -> int:
    return max((i.iter for i in iters), default=0) + 1


def pending_signals(iters: list[Iteration]) -> list[Iteration]:
    """Signal iterations after the last judged one: work in progress that a revert also undoes."""
    out: list[Iteration] = []
    for it in reversed(attempts(iters)):
        if it.status != "signal":
            break
        out.append(it)
    return out  # newest first


def stall_count(iters: list[Iteration], decisions: list[Decision]) -> int:
    """Non-keep iterations (signal rows aside) since the last keep or the last re-assessment."""
    reset = max([i.iter for i in iters if i.status == "keep"]
                + [d.after_iter for d in decisions if d.kind == "reassess"], default=0)
    return sum(1 for i in attempts(iters) if i.iter > reset and i.status not in ("keep", "signal"))


def normalized(direction: str) -> str:
    return re.sub(r"\s+", " ", direction.strip().lower())


def tried(iters: list[Iteration]) -> list[dict]:
    """The directions the log shows as tried, for `reassess` to put in front of the user."""
    return [{"iter": i.iter, "direction": i.direction, "status": i.status, "vs_best": geo_speedup(i.vs_best)}
            for i in attempts(iters)]


def geo_speedup(cmp: dict | None) -> float | None:
    return cmp["geomean"]["speedup"] if cmp and cmp.get("geomean") else None


def directions_with_evidence(iters: list[Iteration]) -> list[str]:
    seen: dict[str, str] = {}
    for i in attempts(iters):
        if i.vs_best and i.vs_best.get("complete") and i.direction.strip():
            seen.setdefault(normalized(i.direction), i.direction)
    return list(seen.values())


def stop_conditions(iters: list[Iteration], max_iters: int) -> list[str]:
    """Why the loop may stop now besides reaching the target: the cap, or enough directions tried."""
    out = []
    n = len(attempts(iters))
    if n >= max_iters:
        out.append(f"iteration cap reached ({n} of {max_iters})")
    dirs = directions_with_evidence(iters)
    if len(dirs) >= MIN_DIRECTIONS:
        out.append(f"{len(dirs)} distinct directions tried with bench evidence")
    return out


# -- stop: go and no-go -------------------------------------------------------------------------

def go_missing(iters: list[Iteration], dispatch: list[DispatchRow], *, target_speedup: float, shapes: list[str],
               modes: list[str], varlen: bool = False, l2: str = "rotate") -> list[tuple[str, str]]:
    """What `stop --go` lacks: (item, why) pairs; empty when the go is earned."""
    keep = best(iters)
    if keep is None or keep.status != "keep":
        return [("keep", "no iteration was kept: nothing is faster than the base")]
    out = []
    gate = keep.gate or {}
    if not gate.get("green") or gate.get("signal_only"):
        out.append(("full gate", f"iteration {keep.iter} has no green full gate"))
    vb = keep.vs_base
    if not vb or not vb.get("complete") or not vb.get("geomean"):
        out.append(("vs base", f"iteration {keep.iter} has no complete measurement against the base"))
    else:
        g = vb["geomean"]
        if g["speedup"] < target_speedup or vb["verdict"] != "FASTER":
            out.append(("target", f"iteration {keep.iter} is {fmt.speedup(g['speedup'])} "
                                  f"{fmt.interval(g['ci_low'], g['ci_high'])} {vb['verdict']} vs base; "
                                  f"the contract's target is {target_speedup:g}x"))
        if varlen and not vb.get("varlen"):
            out.append(("varlen cells", f"the contract has --varlen, but iteration {keep.iter} measured no packed "
                                        f"(cu_seqlens) cell against the base"))
        lacking = [st for st in l2_states(l2) if st not in vb.get("l2", ["rotate"])]
        if lacking:
            out.append(("L2 states", f"the contract has --l2 {l2}, but iteration {keep.iter} measured no "
                                     f"{' or '.join(lacking)} cell against the base"))
        if not covers(vb, shapes, modes):
            out.append(("full shape set", f"iteration {keep.iter} measured {', '.join(vb['shapes'])} "
                                          f"({', '.join(vb['modes'])}); the contract has {', '.join(shapes)} "
                                          f"({', '.join(modes)})"))
    later = [d for d in dispatch if d.after_iter >= keep.iter and d.same_as_iter != keep.iter]
    if later:
        out.append(("full shape set with the dispatch",
                    f"dispatch row(s) {', '.join(str(d.n) for d in later)} came after iteration {keep.iter}: "
                    f"a bucket's measurement is not the full shape set; commit the dispatch with `flaloop iter` "
                    f"so every shape is measured with it"))
    return out


def no_go_missing(iters: list[Iteration], bound) -> list[tuple[str, str]]:
    """The five-item no-go bar: each missing item by name, with why. `bound` is the --bound checked
    against the records (loop/bounds.Checked), or None when none was given."""
    out = []
    if baseline_of(iters) is None:
        out.append(("baseline", "no baseline is recorded (`flaloop baseline`)"))
    tries = attempts(iters)
    if not any(i.direction.strip() for i in tries):
        out.append(("candidate attempt", "no iteration with a direction was tried (`flaloop iter OP \"...\"`)"))
    if not any(i.gate and not i.gate.get("signal_only") for i in tries):
        out.append(("gate status", "no attempt ran the full gate (a -k signal gate does not count)"))
    if not any(i.vs_best and i.vs_best.get("complete") for i in tries):
        out.append(("bench evidence", "no attempt has a complete paired measurement against the best"))
    if bound is None or not bound.ok:
        out.append(("named bound", bound.why if bound is not None else
                    "name the limit flaloop measured: --bound KIND[@CELL][: note] (see `flaloop stop --help`)"))
    return out


# -- where the loop stands ----------------------------------------------------------------------

def speedup_vs_base(it: Iteration | None) -> float | None:
    return geo_speedup(it.vs_base) if it is not None and it.status == "keep" else None


def state(iters: list[Iteration], decisions: list[Decision], dispatch: list[DispatchRow], *, op: str,
          target_speedup: float, max_iters: int, shapes: list[str], modes: list[str], varlen: bool = False,
          l2: str = "rotate") -> dict:
    """The phase, the counters and the next command, as `flaloop status` shows them."""
    tries = attempts(iters)
    b = best(iters)
    stall = stall_count(iters, decisions)
    conditions = stop_conditions(iters, max_iters)
    go = go_missing(iters, dispatch, target_speedup=target_speedup, shapes=shapes, modes=modes, varlen=varlen, l2=l2)
    last_stop = next((d for d in reversed(decisions) if d.kind == "stop"), None)
    stopped = last_stop is not None and last_stop.after_iter >= (tries[-1].iter if tries else 0)
    speed = speedup_vs_base(b)
    if baseline_of(iters) is None:
        phase, nxt = "contract", f"flaloop baseline {op}"
    elif stopped:
        phase, nxt = f"stopped ({last_stop.data.get('verdict')})", f"flaloop report {op}"
    elif not go:
        phase, nxt = "target met", f"flaloop stop {op} --go"
    elif len(tries) >= max_iters:
        phase, nxt = "cap reached", f"flaloop stop {op} --no-go --bound \"...\" (or --go once the target is met)"
    elif stall >= STALL_LIMIT:
        phase, nxt = "stalled", (f"flaloop reassess {op} --profiled \"...\" --tried \"...\" --next \"...\" "
                                 f"--why \"...\"")
    else:
        phase, nxt = "iterate", f"edit the kernel, then: flaloop iter {op} \"<one-line direction>\""
        if conditions:
            nxt += f"   (or stop: {'; '.join(conditions)} -> flaloop stop {op} --no-go --bound \"...\")"
    counts = {s: sum(i.status == s for i in tries) for s in ("keep", "revert", "drop", "noise", "signal")}
    last = tries[-1] if tries else baseline_of(iters)
    return {
        "phase": phase, "next": nxt, "iterations": len(tries), "max_iters": max_iters, "counts": counts,
        "best": None if b is None else {"iter": b.iter, "commit": b.commit, "status": b.status,
                                        "direction": b.direction, "vs_base": speed},
        "stall": {"count": stall, "limit": STALL_LIMIT, "stalled": stall >= STALL_LIMIT},
        "last_gate": None if last is None or not last.gate else {"iter": last.iter, **last.gate},
        "target": {"speedup": target_speedup, "best": speed,
                   "remaining": None if speed is None else target_speedup / speed - 1.0, "met": not go,
                   "missing": [{"item": k, "why": v} for k, v in go]},
        "stop_conditions": conditions, "dispatch_rows": len(dispatch),
        "stopped": None if not stopped else {"verdict": last_stop.data.get("verdict"),
                                             "after_iter": last_stop.after_iter},
    }
