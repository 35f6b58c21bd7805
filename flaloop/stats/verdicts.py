"""Verdicts: one cell's CI rule, and the family of cells under Holm's step-down procedure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from flaloop.stats.base import _cells, _Dict, _vector
from flaloop.stats.estimators import Estimator, _estimator
from flaloop.stats.intervals import SpeedupEstimate, _boot_and_jack

# -- verdicts ------------------------------------------------------------------------------------

class Verdict(str, Enum):
    FASTER = "FASTER"
    SLOWER = "SLOWER"
    SAME = "SAME"
    UNSURE = "UNSURE"


def _log_margin(margin: float) -> float:
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be a fraction in [0, 1), e.g. 0.005 for 0.5 %; got {margin}")
    return math.log1p(margin)


def verdict(est: SpeedupEstimate, margin: float = 0.005) -> Verdict:
    """Single-cell CI rule (no multiplicity correction); bounds are 1+margin and 1/(1+margin)."""
    up = math.exp(_log_margin(margin))
    if est.ci_low > up:
        return Verdict.FASTER
    if est.ci_high < 1 / up:
        return Verdict.SLOWER
    if 1 / up < est.ci_low and est.ci_high < up:
        return Verdict.SAME
    return Verdict.UNSURE


@dataclass(frozen=True)
class CellPValues(_Dict):
    """One-sided p-values of one cell; see the module docstring for the hypotheses."""

    faster: float
    slower: float
    same: float


def _rank_p(r: np.ndarray, est: Estimator, delta: float) -> tuple[float, float]:
    """(P for H1 theta < delta, P for H1 theta > delta); ties count against rejection."""
    values, cdf = est.rank_values(r), est.rank_null_cdf(r.size)
    size = values.size
    n_ge = size - int(np.searchsorted(values, delta, "left"))
    n_gt = size - int(np.searchsorted(values, delta, "right"))
    return float(cdf[n_ge]), float(cdf[size - n_gt])  # null is symmetric: P(T >= t) = P(T <= N - t)


def _boot_p(boot: np.ndarray, delta: float) -> tuple[float, float]:
    b = boot.size
    return float((1 + (boot >= delta).sum()) / (b + 1)), float((1 + (boot <= delta).sum()) / (b + 1))


def cell_pvalues(r: Sequence[float] | np.ndarray, margin: float = 0.005, estimator: str = "hl",
                 test: str = "rank", n_boot: int = 2000, seed: int = 0) -> CellPValues:
    """p_faster, p_slower and the TOST p_same of one cell's log ratios."""
    a, est, lam = _vector(r, "log ratios", min_n=2), _estimator(estimator), _log_margin(margin)
    if test == "rank":
        (lt_lo, gt_lo), (lt_hi, gt_hi) = _rank_p(a, est, -lam), _rank_p(a, est, lam)
    elif test == "bootstrap":
        boot, _ = _boot_and_jack(a, est, n_boot, np.random.default_rng(seed), jackknife=False)
        (lt_lo, gt_lo), (lt_hi, gt_hi) = _boot_p(boot, -lam), _boot_p(boot, lam)
    else:
        raise ValueError(f"unknown test {test!r}; known: rank, bootstrap")
    return CellPValues(faster=lt_lo, slower=gt_hi, same=max(gt_lo, lt_hi))


def holm_adjust(pvalues: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm-adjusted p-values: reject hypothesis i at level a iff adjusted[i] <= a."""
    p = np.asarray(pvalues, dtype=float)
    if p.ndim != 1 or np.any(~np.isfinite(p)) or np.any((p < 0) | (p > 1)):
        raise ValueError(f"p-values must be a 1-D sequence in [0, 1], got {p}")
    order = np.argsort(p, kind="stable")
    scaled = (p.size - np.arange(p.size)) * p[order]
    adjusted = np.empty_like(p)
    adjusted[order] = np.minimum(np.maximum.accumulate(scaled), 1.0)
    return adjusted


def holm_verdicts(cells: Sequence[np.ndarray], margin: float = 0.005, alpha: float = 0.05, seed: int = 0,
                  estimator: str = "hl", test: str = "rank", n_boot: int = 2000) -> list[Verdict]:
    """Verdicts of a family of cells, Holm-corrected per family (FASTER, SLOWER, SAME) at alpha/2."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    ps = [cell_pvalues(c, margin, estimator, test, n_boot, seed + i) for i, c in enumerate(_cells(cells))]
    reject = {name: holm_adjust([getattr(p, name) for p in ps]) <= alpha / 2
              for name in ("faster", "slower", "same")}
    out = []
    for i in range(len(ps)):
        if reject["faster"][i]:
            out.append(Verdict.FASTER)
        elif reject["slower"][i]:
            out.append(Verdict.SLOWER)
        elif reject["same"][i]:
            out.append(Verdict.SAME)
        else:
            out.append(Verdict.UNSURE)
    return out
