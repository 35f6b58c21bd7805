"""The guard's timing cross-checks, paired and noise-aware: pure functions over a cell's pairs.

Each check compares a quantity of the candidate with the same quantity of the base. Both are read
in the same pair (two processes timed back to back), so what the machine does to a pair (another
process on the GPU, a loaded host) moves both halves; the per-pair difference is the statistic.
A difference blocks only when all of these hold (docs/GUARD.md, "Timing checks under contention"):

* its rank interval (Hodges-Lehmann, `stats.shift_interval`) lies wholly beyond a tolerance;
* the tolerance is the larger of a minimum effect relative to the cell's time (a difference too
  small to fake a verdict is not a finding) and `SPREAD_Z` times the spread the base shows
  against itself (the robust SD of the base's own per-pair reading): an excess the base's own
  readings reach is noise, not evidence;
* every round (fresh processes, the order swapped) shows it: a timer trick is in the code, so it
  is in every round; a process that happened to run beside a busy neighbour is in one;
* judged on pairs beside another process, it is also at least `CONTENDED_SHARE` of the call: what
  the neighbour does to one side's host and launches is not noise a pair cancels, and a smaller
  under-report is left to `--exclusive`.

Where pairs ran beside another process on the GPU (`Pair.foreign`), the uncontended pairs decide
when there are enough of them; when there are not and the difference is material but not
decisive, the finding is `contended-unsure`: a warning with the numbers and the advice to measure
again with `--exclusive`, never a block.
"""

from __future__ import annotations

import math
import statistics

from flaloop import stats
from flaloop.guard import catalogue
from flaloop.guard.findings import WARN, Finding

MIN_PAIRS = 4           # a cross-check needs this many pairs with both readings
SPREAD_Z = 2.0          # an excess must pass this many robust SDs of the base's own reading
CONTENDED_SHARE = 0.03  # beside another process, an excess decides only past this share of the call
MAD_SD = 1.4826         # median absolute deviation -> standard deviation under normal noise
FLOOR_SLACK = 0.95      # the ceilings' own measurement error: a candidate above 95% of its floor passes
EXCLUSIVE = "measure again with `--exclusive` (waits for the GPU to be free, drops pairs beside others)"


def _finding(rule: str, message: str, cell: str | None, severity: str | None = None) -> Finding:
    f = catalogue.finding(rule, message, severity=severity)
    return Finding(**{**f.__dict__, "cell": cell, "side": "cand"})


def robust_sd(xs: list[float]) -> float:
    """MAD-based standard deviation: a few contended outliers do not inflate it."""
    if len(xs) < 2:
        return 0.0
    m = statistics.median(xs)
    return MAD_SD * statistics.median(abs(x - m) for x in xs)


def _quiet(p) -> bool:
    """A pair NVML saw alone on the GPU. One it could not list (`foreign` None: a process list that
    shows nobody, as in a container without the host's PID namespace) may have had company, so it is
    judged as contended."""
    return getattr(p, "foreign", None) == []


class Shift:
    """The paired comparison of one quantity: per-pair differences (candidate minus base), the
    base's own readings, and each pair's round."""

    def __init__(self, diffs: list[float], base: list[float], rounds: list[int], min_effect: float,
                 decisive_effect: float | None = None):
        self.n = len(diffs)
        self.point, self.low, self.high = stats.shift_interval(diffs)
        self.noise = robust_sd(base)
        self.min_effect = min_effect
        # beside another process a smaller excess is said (`material`) but only a larger one decides
        self.decisive_effect = max(min_effect, decisive_effect or 0.0)
        self.tol = max(self.decisive_effect, SPREAD_Z * self.noise)
        by_round: dict[int, list[float]] = {}
        for d, r in zip(diffs, rounds, strict=True):
            by_round.setdefault(r, []).append(d)
        self.rounds = {r: statistics.median(v) for r, v in sorted(by_round.items()) if len(v) >= 2}

    @property
    def decisive(self) -> bool:
        """Beyond the tolerance, with every round's own median past the minimum effect."""
        return self.low > self.tol and all(m > self.decisive_effect for m in self.rounds.values())

    @property
    def material(self) -> bool:
        """Past the minimum effect, but perhaps within what the base shows against itself."""
        return self.low > self.min_effect

    def describe(self, unit: float, label: str) -> str:
        u = "us" if unit == 1e3 else "%"
        return (f"{label} {self.point * unit:.1f} {u} [{self.low * unit:.1f}, {self.high * unit:.1f}] over {self.n} "
                f"pairs; the base's own spread {self.noise * unit:.1f} {u}, tolerance {self.tol * unit:.1f} {u}"
                + (f"; per round {', '.join(f'{m * unit:.1f}' for m in self.rounds.values())} {u}"
                   if len(self.rounds) > 1 else ""))


def _judged(rows: list) -> tuple[list, str, bool]:
    """The pairs to judge on (the uncontended ones when there are enough, else all of them), what
    they are in words, and whether the judgement rests on contended pairs."""
    clean = [p for p in rows if _quiet(p)]
    if len(clean) >= MIN_PAIRS:
        return clean, (f"the {len(clean)} pairs with the GPU to themselves" if len(clean) < len(rows) else ""), False
    busy = sum(bool(p.foreign) for p in rows)
    unseen = sum(p.foreign is None for p in rows)
    where = ", ".join(x for x in (f"{busy} of {len(rows)} pairs beside another process on the GPU" if busy else "",
                                  f"{unseen} of {len(rows)} pairs NVML could not list processes for" if unseen else "")
                      if x)
    return rows, where, True


def _unsure(cell: str, rule: str, what: str, contended: bool, where: str = "") -> Finding:
    """Neither a block nor silence: the check could not decide, and says what would settle it."""
    if contended:
        return _finding("contended-unsure", f"{rule} cannot decide: {what} ({where}); {EXCLUSIVE}", cell)
    return _finding(rule, f"unsure, not blocking: {what}; within what the base varies by against itself, or not "
                    f"in every round; {EXCLUSIVE}", cell, severity=WARN)


def wall_gap_shift(pairs: list, k: int | None) -> tuple[Shift, list, str, bool] | None:
    """The paired wall-minus-device gap excess of a cell's pairs (None below `MIN_PAIRS`): the Shift,
    the pairs judged, what they are in words, and whether they were contended."""
    rows = [p for p in pairs if p.dropped is None and p.base_wall_ms and p.cand_wall_ms]
    if len(rows) < MIN_PAIRS:
        return None
    judged, where, contended = _judged(rows)
    per_call = statistics.median(p.base_ms for p in judged)
    k = max(1, k or 1)
    gap = Shift([(p.cand_wall_ms - p.cand_ms) - (p.base_wall_ms - p.base_ms) for p in judged],
                [p.base_wall_ms - p.base_ms for p in judged], [p.round for p in judged],
                min_effect=0.002 * per_call + 0.02 / k, decisive_effect=CONTENDED_SHARE * per_call if contended else None)
    return gap, judged, where, contended


def timer_wall_gap(cell: str, pairs: list, k: int | None, timer: str | None) -> Finding | None:
    """Device time vs host wall time of the same synchronized graph replays, base against candidate.

    For a CUDA-graph sample wall = device + a constant (the replay's launch and the final sync), the
    same on both sides; a timer that under-reports, or work on a stream the events do not see, adds
    a gap on its side in every pair. Per pair: (candidate's wall - device) - (base's wall - device),
    per call. Minimum effect: 0.2% of the base's per-call time plus 20 us per sample (the replay's
    own jitter); a 1% fake on a 10 ms sample leaves 100 us. Also: the candidate's device time
    above its wall time (impossible for an honest timer) in most pairs where the base's is not.
    """
    if timer != "cuda_graph":
        return None
    got = wall_gap_shift(pairs, k)
    if got is None:
        return None
    gap, judged, where, contended = got
    k = max(1, k or 1)
    what = gap.describe(1e3, "the candidate's device time falls short of its wall time by more than the base's:")
    if gap.decisive:
        return _finding("timer-wall-gap", what + (f" (judged on {where})" if where else ""), cell)
    if gap.material:
        return _unsure(cell, "timer-wall-gap", what, contended, where)

    def over(ms, wall):
        return ms > wall * 1.001 + 0.01 / k
    over_c = sum(over(p.cand_ms, p.cand_wall_ms) for p in judged)
    over_b = sum(over(p.base_ms, p.base_wall_ms) for p in judged)
    if over_c > len(judged) // 2 and over_b <= len(judged) // 4:
        return _finding("timer-wall-gap", f"device time exceeds wall time in {over_c} of {len(judged)} candidate "
                        f"samples (base: {over_b})", cell)
    return None


HOST_SHARE = 0.01     # timer-host-gap: an unexplained gap under this share of the sample is no finding
HOST_SLACK_MS = 0.2   # ... nor one under this (a round trip's pipe, JSON and scheduling jitter)
# A sample runs a few calls of the op outside its timed window (the first sync, the kept call's copy):
# a candidate slower per call leaves that much more in its round trip, honestly. The allowance is on
# the candidate's own reported per-call time, so a timer forged to read short earns none of it.
UNTIMED_CALLS = 3


def host_gap_shift(pairs: list) -> tuple[Shift, list, str, bool] | None:
    """The paired excess of the candidate's unexplained round-trip gap over the base's (None below
    `MIN_PAIRS` pairs with both sides' readings): the Shift in ms per sample, the pairs judged, what
    they are in words, and whether they were contended. A side's gap is the sample request's round
    trip on the orchestrator's clock minus the time its worker reported for the sample."""
    rows = [p for p in pairs if p.dropped is None and p.base_rtt_ms and p.cand_rtt_ms
            and p.base_reported_ms and p.cand_reported_ms]
    if len(rows) < MIN_PAIRS:
        return None
    judged, where, contended = _judged(rows)
    sample = statistics.median(p.base_reported_ms for p in judged)
    gap = Shift([(p.cand_rtt_ms - p.cand_reported_ms) - (p.base_rtt_ms - p.base_reported_ms)
                 - UNTIMED_CALLS * max(0.0, (p.cand_ms or 0.0) - (p.base_ms or 0.0)) for p in judged],
                [p.base_rtt_ms - p.base_reported_ms for p in judged], [p.round for p in judged],
                min_effect=HOST_SHARE * sample + HOST_SLACK_MS,
                decisive_effect=CONTENDED_SHARE * sample if contended else None)
    return gap, judged, where, contended


def timer_host_gap(cell: str, pairs: list) -> Finding | None:
    """Each side's reported sample time against the round trip the orchestrator timed with its own
    clock, which no code in a worker reaches; every timer (graph, eager, CPU) and every way of
    forging it (a Python wrapper, a builtin's C function pointer, a hooked CUDA runtime).

    An honest worker's report is below its round trip by an overhead (the pipe, the JSON, the
    integrity watch, the final sync) that the base's identical path shows too. A timer that reads
    short leaves the time it hid in the candidate's gap, in every pair. Per pair: (candidate's round
    trip - report) - (base's round trip - report), per sample; judged as every timing check is
    (module docstring), with a minimum effect of `HOST_SHARE` of the base's sample plus
    `HOST_SLACK_MS`, and beside another process (or unlisted) `CONTENDED_SHARE` of the sample."""
    got = host_gap_shift(pairs)
    if got is None:
        return None
    gap, _, where, contended = got
    what = gap.describe(1e3, "the candidate's reported sample time falls short of the round trip flaloop timed by "
                             "more than the base's:")
    if gap.decisive:
        return _finding("timer-host-gap", what + (f" (judged on {where})" if where else ""), cell)
    if gap.material:
        return _unsure(cell, "timer-host-gap", what, contended, where)
    return None


def eager_disagrees(cell: str, speedup: float | None, eager: dict, contended: bool = False) -> Finding | None:
    """A device-time win the eager wall time does not show, on a cell that is not launch-bound.

    `eager`: the cell's raw eager samples ({"base": {"wall_ms": [...], "host_ms": [...]}, "cand": ...}),
    taken in turns, so sample i of each side forms a pair. Only a clear device win is judged (5%):
    it blocks when the paired eager speedup's interval lies wholly below a third of it (in log
    terms) while the base's own eager calls vary by less than the win; otherwise, when the eager
    speedup reads below the third, it says it is unsure."""
    try:
        eb, ec = list(eager["base"]["wall_ms"]), list(eager["cand"]["wall_ms"])
        hb, hc = list(eager["base"]["host_ms"]), list(eager["cand"]["host_ms"])
    except (KeyError, TypeError):
        return None
    n = min(len(eb), len(ec))
    if speedup is None or speedup < 1.05 or n < 2 or min(eb[:n] + ec[:n]) <= 0:
        return None
    if max(statistics.median(hb), statistics.median(hc)) > 0.5 * min(statistics.median(eb), statistics.median(ec)):
        return None  # host-bound: the wall time is the launch cost, not the kernel
    s = math.log(speedup)
    le = [math.log(eb[i] / ec[i]) for i in range(n)]
    point, low, high = stats.shift_interval(le)
    noise = robust_sd([math.log(x) for x in eb[:n]])
    what = (f"device time says {speedup:.3f}x, eager wall time {math.exp(point):.3f}x "
            f"[{math.exp(low):.3f}, {math.exp(high):.3f}] over {n} paired calls; the base's own calls spread "
            f"{noise:.1%}")
    if high < s / 3 and SPREAD_Z * noise < s and not contended:
        return _finding("eager-disagrees", what, cell)
    if high < s / 3 and SPREAD_Z * noise < s / 3:  # decisive even beside another process
        return _finding("eager-disagrees", what + " (beside another process on the GPU)", cell)
    if point < s / 3:
        return _unsure(cell, "eager-disagrees", what, contended, "pairs beside another process on the GPU")
    return None


def floor_uncertain(ceilings: dict | None, bound: str | None, dtype: str | None) -> str | None:
    """Why a cell's roofline floor cannot be held against it (None: it can). The floor is a lower
    bound only where the ceilings bound what the cell can reach: a compute floor from a GEMM
    measured in a wider type than the cell may use (an fp8 cell, a bf16 rate) is not one."""
    if not ceilings:
        return "no measured ceilings"
    if not (ceilings.get("bandwidth_gbs") or 0) > 0 or not (ceilings.get("peak_tflops") or 0) > 0:
        return "the ceilings are incomplete"
    width = {"float8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1, "bfloat16": 2, "bf16": 2,
             "float16": 2, "fp16": 2, "float32": 4, "fp32": 4, "float64": 8}
    gemm = width.get(str(ceilings.get("gemm_dtype") or ""))
    mine = width.get(str(dtype or "bfloat16").replace("torch.", ""))
    if bound == "compute" and (gemm is None or mine is None or mine < gemm):
        return f"a compute floor from a {ceilings.get('gemm_dtype')} GEMM rate on a {dtype} cell"
    return None


def below_floor(cell: str, cand_ms: float | None, floor_ms: float | None, base_ms: float | None = None,
                uncertain: str | None = None) -> Finding | None:
    """The candidate's median time below the cell's roofline floor (with `FLOOR_SLACK`): it cannot
    have done the work. A warning instead when the base is below it too (the model is off for this
    op) or the floor is uncertain (`floor_uncertain`)."""
    if not cand_ms or not floor_ms or cand_ms >= FLOOR_SLACK * floor_ms:
        return None
    msg = (f"measured {cand_ms:.4g} ms per call, floor {floor_ms:.4g} ms: {floor_ms / cand_ms:.2f}x below the "
           "roofline floor")
    if base_ms and base_ms < FLOOR_SLACK * floor_ms:
        return _finding("below-floor", msg + f" (the base's {base_ms:.4g} ms is below it too: the model is off for "
                        "this op)", cell, severity=WARN)
    if uncertain:
        return _finding("below-floor", msg + f" (not blocking: the floor is uncertain, {uncertain})", cell,
                        severity=WARN)
    return _finding("below-floor", msg, cell)


SAME_CODE_SPEEDUP = 1.10  # the CI's low end a cell of unchanged code may not pass


def same_code_speedup(cell: str, speedup: float | None, ci_low: float | None, pairs: list) -> Finding | None:
    """A clear win on a candidate whose code is the base's (the diff changes comments, docstrings or
    layout only, guard/audit.same_code): whatever made it faster is not in the diff (the environment,
    a cache, the measurement itself). Blocks when the CI's low end passes `SAME_CODE_SPEEDUP` on
    pairs seen alone on the GPU; beside another process (or unlisted) it is `contended-unsure`."""
    if not speedup or not ci_low or ci_low <= SAME_CODE_SPEEDUP:
        return None
    msg = (f"the candidate's code is the base's (the diff changes comments, docstrings or layout only), yet "
           f"this cell reads {speedup:.3f}x with its CI's low end at {ci_low:.3f}x (limit {SAME_CODE_SPEEDUP:.2f}x): "
           "the win is not in the diff")
    kept = [p for p in pairs if getattr(p, "dropped", None) is None]
    if kept and all(_quiet(p) for p in kept):
        return _finding("implausible-speedup", msg, cell)
    return _finding("contended-unsure", f"implausible-speedup cannot decide: {msg} (pairs beside other processes, "
                    f"or not listed); {EXCLUSIVE}", cell)
