"""The geomean over cells and its interval, built from the cells' own intervals."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flaloop.stats.base import _cells, _check_confidence, _Dict
from flaloop.stats.estimators import _estimator
from flaloop.stats.intervals import _boot_and_jack, _interval, _rank_interval
from flaloop.stats.special import t_quantile
from flaloop.stats.verdicts import Verdict, holm_verdicts

# -- aggregate -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GeomeanEstimate(_Dict):
    """Equal-weight geomean of per-cell speedups with its CI (see ``geomean``)."""

    speedup: float
    ci_low: float
    ci_high: float
    worst_cell: int
    worst_speedup: float
    n_regressions: int
    n_cells: int
    method: str = "hl+rank"
    df: float | None = None  # the t quantile's degrees of freedom ("rank" method)


GEOMEAN_METHODS = ("rank", "bca")


def combined_interval(thetas: np.ndarray, bounds: list[tuple[float, float]], ns: list[int],
                       confidence: float) -> tuple[float, float, float]:
    """(low, high, df) for mean(theta_i) from each cell's own interval (low_i, high_i) on n_i pairs.

    Each side of a cell's interval is read back as a standard error, ``s = (theta - low) / t(n - 1)``,
    the errors add in quadrature over the mean, and the t quantile takes the Welch-Satterthwaite
    degrees of freedom. With one cell this returns that cell's interval exactly.
    """
    if any(not (math.isfinite(lo) and math.isfinite(hi)) for lo, hi in bounds):
        return -math.inf, math.inf, float(min(ns) - 1)
    p = (1 + confidence) / 2
    q = np.array([t_quantile(n - 1, p) for n in ns])
    s_lo = (thetas - np.array([b[0] for b in bounds])) / q
    s_hi = (np.array([b[1] for b in bounds]) - thetas) / q
    m = thetas.size
    s = (s_lo + s_hi) / 2
    den = float(np.sum(s ** 4 / (np.array(ns) - 1)))
    df = float(np.sum(s ** 2) ** 2 / den) if den > 0 else float(min(ns) - 1)
    qq = float(t_quantile(df, p))
    center = float(thetas.mean())
    return (center - qq * math.sqrt(float(np.sum(s_lo ** 2))) / m,
            center + qq * math.sqrt(float(np.sum(s_hi ** 2))) / m, df)


def geomean(cells: Sequence[np.ndarray], verdicts: Sequence[Verdict] | None = None, confidence: float = 0.95,
            n_boot: int = 2000, seed: int = 0, estimator: str = "hl", margin: float = 0.005,
            alpha: float = 0.05, method: str = "rank") -> GeomeanEstimate:
    """Geomean speedup over cells; verdicts (default: holm_verdicts) give n_regressions.

    ``method="rank"`` (default) builds the interval from the cells' own rank intervals
    (``combined_interval``): one cell's geomean interval is that cell's interval, so a keep never
    rests on a narrower interval than the per-cell rule trusts, and the coverage is the cells'
    (tests/unit/test_stats.py measures it at n = 6 to 32). ``method="bca"``: the joint bootstrap (each
    replicate resamples every cell's pairs; BCa with the multi-sample jackknife), which undercovers
    below ~16 pairs a cell (86-90 % at one cell of 6-8 pairs) and is kept for comparison.
    """
    cs, est = _cells(cells), _estimator(estimator)
    _check_confidence(confidence)
    if method not in GEOMEAN_METHODS:
        raise ValueError(f"unknown geomean CI method {method!r}; known: {', '.join(GEOMEAN_METHODS)}")
    if n_boot < 100 and method != "rank":
        raise ValueError(f"n_boot={n_boot} is too few bootstrap resamples for a CI; use >= 100")
    if verdicts is None:
        verdicts = holm_verdicts(cs, margin=margin, alpha=alpha, estimator=estimator)
    if len(verdicts) != len(cs):
        raise ValueError(f"got {len(verdicts)} verdicts for {len(cs)} cells")
    thetas = np.array([est.point(c) for c in cs])
    m = len(cs)
    df = None
    if method == "rank":
        bounds = [_rank_interval(c, est, confidence) if c.size >= 2 else (-math.inf, math.inf) for c in cs]
        lo, hi, df = combined_interval(thetas, bounds, [max(2, c.size) for c in cs], confidence)
        used = "rank"
    else:
        rng = np.random.default_rng(seed)
        boots, jacks = zip(*(_boot_and_jack(c, est, n_boot, rng) for c in cs), strict=True)
        # jackknife of the joint statistic: delete one pair of cell j, the other cells unchanged
        joint_jacks = [(thetas.sum() - thetas[j] + jacks[j]) / m for j in range(m)]
        lo, hi, used = _interval(float(thetas.mean()), np.mean(boots, axis=0), joint_jacks, confidence)
    worst = int(np.argmax(thetas))
    return GeomeanEstimate(speedup=math.exp(-thetas.mean()), ci_low=math.exp(-hi), ci_high=math.exp(-lo),
                           worst_cell=worst, worst_speedup=math.exp(-thetas[worst]),
                           n_regressions=sum(Verdict(v) is Verdict.SLOWER for v in verdicts),
                           n_cells=m, method=f"{est.name}+{used}", df=df)
