"""Analysis of a session's results: pure functions of the measured pairs, never re-measuring.

Per cell: the paired estimate and CI, Holm-corrected verdicts across cells, per-round estimates
(a verdict stands only when every round agrees with its direction), per-side summaries, the
launch-bound flag; then the guard's judgment of the timing itself (device vs wall time, device
vs eager speedup); across cells: the equal-weight geomean with its joint CI.
"""

from __future__ import annotations

import math

import numpy as np

from flaloop import stats
from flaloop.bench.model import MIN_PAIRS_JUDGED, CellResult, CellSummary, RoundEstimate
from flaloop.bench.record import GeomeanSummary, RunSummary
from flaloop.guard import timing
from flaloop.guard.findings import Finding


def tuning_differences(base: dict, cand: dict) -> list[str]:
    """Kernels that both sides tuned for the same key but that chose different configs.

    `base` and `cand` are the workers' {kernel: {key: config}} choices made while warming a cell.
    """
    out = []
    for kernel in sorted(base.keys() & cand.keys()):
        for key in sorted(base[kernel].keys() & cand[kernel].keys()):
            b, c = base[kernel][key], cand[kernel][key]
            if b != c:
                out.append(f"{kernel} {key}: base [{b}] cand [{c}]")
    return out


def round_estimates(res: CellResult, seed: int = 0) -> tuple[list[RoundEstimate], bool]:
    """Each round's own speedup estimate and CI, and whether two rounds' CIs fail to overlap.

    Rounds run in fresh processes with the start order swapped, so a speedup that belongs to the
    code shows in every round, while one that belongs to a process (where its buffers landed,
    which process started first) moves between rounds.
    """
    by_round: dict[int, list[float]] = {}
    for p in res.kept:
        by_round.setdefault(p.round, []).append(math.log(p.cand_ms / p.base_ms))
    if len(by_round) < 2:
        return [], False
    out = []
    for rnd in sorted(by_round):
        lr = by_round[rnd]
        if len(lr) < 2:
            continue
        est = stats.estimate_speedup(lr, seed=seed)
        out.append(RoundEstimate(round=rnd + 1, n_pairs=len(lr), speedup=est.speedup, ci_low=est.ci_low,
                                 ci_high=est.ci_high))
    disagree = any(a.ci_high < b.ci_low or b.ci_high < a.ci_low for i, a in enumerate(out) for b in out[i + 1:])
    return out, disagree


def split_direction(rounds: list[RoundEstimate], verdict: stats.Verdict, margin: float) -> bool:
    """True when a FASTER or SLOWER verdict is not borne out by every round's own estimate.

    On the H200 the process that started and set up first ran a cell ~0.55% slower (A/A of
    chunk_delta_rule B8_T2048_H32_D256 fwd, four rounds: -0.58, +0.56, -0.66, +0.46%). Swapping
    the order each round cancels that in the pooled estimate, so rounds that merely differ do
    not veto a verdict (a planted 3-6% slowdown stays SLOWER); a round whose own estimate does
    not clear the margin in the verdict's direction does.
    """
    if verdict not in (stats.Verdict.FASTER, stats.Verdict.SLOWER) or not rounds:
        return False
    m = math.log1p(margin)
    if verdict is stats.Verdict.FASTER:
        return not all(math.log(r.speedup) > m for r in rounds)
    return not all(math.log(r.speedup) < -m for r in rounds)


def settled(est: stats.SpeedupEstimate | None, margin: float, band: float) -> str | None:
    """'beyond' when the CI lies beyond the margin by more than `band`, 'inside' when it lies inside
    the margin shrunk by `band` (only possible with a band narrower than the margin), else None."""
    if est is None or est.n_pairs < MIN_PAIRS_JUDGED:
        return None
    hi_edge, lo_edge = (1 + margin) * (1 + band), 1 / ((1 + margin) * (1 + band))
    if est.ci_low > hi_edge or est.ci_high < lo_edge:
        return "beyond"
    if band < margin and (1 + margin) / (1 + band) > est.ci_high and est.ci_low > (1 + band) / (1 + margin):
        return "inside"
    return None


def _judge_timing(r: CellResult) -> None:
    """The guard's paired timing cross-checks (guard/timing.py) over the cell's kept pairs."""
    contended = any(p.foreign for p in r.kept)
    for f in (timing.timer_wall_gap(r.cell.id, r.pairs, r.k, r.timer),
              timing.eager_disagrees(r.cell.id, r.estimate.speedup if r.estimate else None, r.eager, contended)):
        if f is not None:
            r.findings.append(f)


def analyse(results: list[CellResult], margin: float, seed: int = 0, aa: bool = False,
            run_blocked: list[Finding] | None = None) -> RunSummary:
    """Estimates, verdicts and the geomean; blocking findings (the cell's own, or the run's:
    `run_blocked`) turn a cell's verdict into BLOCKED, whatever it measured."""
    measured = [r for r in results if r.status == "ok"]
    ratios = [r.log_ratios() for r in measured]
    verdicts = stats.holm_verdicts(ratios, margin=margin, seed=seed) if measured else []
    for i, r in enumerate(measured):
        r.rounds, r.rounds_disagree = round_estimates(r, seed)
        if not split_direction(r.rounds, verdicts[i], margin):
            continue
        verdicts[i] = stats.Verdict.UNSURE
        r.reason = (r.reason + "; " if r.reason else "") + (
            "rounds disagree on the direction (" + ", ".join(f"{x.speedup:.4f}x" for x in r.rounds)
            + "): not a verdict")
    for r, lr, v in zip(measured, ratios, verdicts, strict=True):
        r.estimate = stats.estimate_speedup(lr, seed=seed)
        r.verdict = v.value
        r.summary = CellSummary(base=stats.summarize([p.base_ms for p in r.kept]),
                                cand=stats.summarize([p.cand_ms for p in r.kept]))
        host = r.eager.get("base", {}).get("host_ms")
        if host and r.eager.get("cand", {}).get("host_ms"):
            r.summary.eager = {s: stats.summarize(e["wall_ms"]) for s, e in r.eager.items()}
            r.summary.host = {s: stats.summarize(e["host_ms"]) for s, e in r.eager.items()}
            r.launch_bound = float(np.median(host)) > r.summary.base.median
        if not aa:
            _judge_timing(r)
    for r in results:
        blocking = [f for f in r.findings if f.blocking] + list(run_blocked or [])
        if r.status == "ok" and blocking:
            was = r.verdict
            r.verdict = "BLOCKED"
            rules = sorted({f.rule for f in blocking})
            r.reason = (r.reason + "; " if r.reason else "") + f"guard: {', '.join(rules)} (measured {was})"
        elif r.status != "ok":
            r.verdict = r.status.upper()
    geo = None
    if measured:
        est = stats.geomean(ratios, verdicts=verdicts, seed=seed)
        named: dict = {"worst_cell_id": measured[est.worst_cell].cell.id}
        if len(measured) > 2:
            # leave-one-out: how much the geomean leans on its single best cell (a near-zero cell
            # collapsing the geomean is a known way to fake a win)
            thetas = [-math.log(r.estimate.speedup) for r in measured]
            best = int(np.argmin(thetas))
            named.update(without_best_cell=math.exp(-float(np.mean([t for i, t in enumerate(thetas) if i != best]))),
                         best_cell_id=measured[best].cell.id)
        geo = GeomeanSummary(**est.to_dict(), **named)
    return RunSummary(geomean=geo, n_cells=len(results), n_measured=len(measured),
                      n_blocked=sum(r.verdict == "BLOCKED" for r in results),
                      n_refused=sum(r.status == "refused" for r in results),
                      n_failed=sum(r.status == "failed" for r in results))
