"""One cell's speedup and its confidence interval: the rank interval (the default), BCa and
percentile bootstraps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flaloop.stats.base import _check_confidence, _Dict, _vector
from flaloop.stats.estimators import Estimator, _estimator
from flaloop.stats.special import ndtr, ndtri

METHODS = ("bca", "percentile", "rank")
MIN_BOOTSTRAP_PAIRS = 10  # below it bootstrap CIs undercover (HL BCa: 88 % at n = 6); rank CI used


# -- bootstrap -------------------------------------------------------------------------------------

def _resample_counts(n: int, n_boot: int, rng: np.random.Generator, order: np.ndarray) -> np.ndarray:
    """counts[k, p]: times the value at sorted position p is drawn in resample k.

    Draws the indices as scipy.stats.bootstrap does, so a generator gives the same resamples.
    """
    idx = np.argsort(order)[rng.integers(0, n, (n_boot, n))]  # original index -> sorted position
    idx += n * np.arange(n_boot)[:, None]
    return np.bincount(idx.ravel(), minlength=n_boot * n).reshape(n_boot, n)


def _boot_and_jack(r: np.ndarray, est: Estimator, n_boot: int,
                   rng: np.random.Generator, jackknife: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """Bootstrap replicates and (optionally) jackknife values of the estimator, in one pass."""
    order = np.argsort(r, kind="stable")
    counts = _resample_counts(r.size, n_boot, rng, order)
    if jackknife:
        counts = np.vstack([counts, 1 - np.eye(r.size, dtype=counts.dtype)])
    values = est.resampled(r[order], counts)
    if not jackknife:
        return values, None
    return values[:n_boot], values[n_boot:][np.argsort(order)]  # jackknife back in input order


def _bca_levels(theta: float, boot: np.ndarray, jacks: list[np.ndarray],
                alpha: float) -> tuple[float, float]:
    """BCa quantile levels, Efron & Tibshirani 14.3 / 15.4, as in scipy.stats.bootstrap."""
    z0 = ndtri(((boot < theta).sum() + (boot <= theta).sum()) / (2 * boot.size))
    num = den = 0.0
    for jack in jacks:
        u = (jack.size - 1) * (jack.mean() - jack)
        num += (u ** 3).sum() / jack.size ** 3
        den += (u ** 2).sum() / jack.size ** 2
    a = num / (6 * den ** 1.5)
    z = ndtri(alpha)
    return (float(ndtr(z0 + (z0 + z) / (1 - a * (z0 + z)))),
            float(ndtr(z0 + (z0 - z) / (1 - a * (z0 - z)))))


def _interval(theta: float, boot: np.ndarray, jacks: list[np.ndarray] | None,
              confidence: float) -> tuple[float, float, str]:
    """(low, high, method) for theta; BCa when jacks is given and BCa is defined."""
    alpha = (1 - confidence) / 2
    if jacks is not None and boot.min() < boot.max():  # BCa needs a spread to correct
        with np.errstate(divide="ignore", invalid="ignore"):
            levels = _bca_levels(theta, boot, jacks, alpha)
        if all(np.isfinite(levels)):
            lo, hi = np.quantile(boot, levels)
            return float(lo), float(hi), "bca"
    lo, hi = np.quantile(boot, [alpha, 1 - alpha])
    return float(lo), float(hi), "percentile"


def _rank_interval(r: np.ndarray, est: Estimator, confidence: float) -> tuple[float, float]:
    values = est.rank_values(r)
    cdf = est.rank_null_cdf(r.size)
    c = int(np.searchsorted(cdf, (1 - confidence) / 2, "right")) - 1
    if c < 0:
        return -math.inf, math.inf
    return float(values[c]), float(values[values.size - 1 - c])


def shift_interval(values: Sequence[float] | np.ndarray, confidence: float = 0.95) -> tuple[float, float, float]:
    """The Hodges-Lehmann location of paired differences and its rank interval: (point, low, high).
    Below the 6 values a 95 % rank interval needs, the interval is the values' range (every pair
    on one side of a bound is then the only evidence there is)."""
    a = _vector(values, "differences", min_n=1)
    est = _estimator("hl")
    lo, hi = _rank_interval(a, est, confidence) if a.size >= 2 else (-math.inf, math.inf)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = float(a.min()), float(a.max())
    return est.point(a), lo, hi


# -- speedup of one cell -------------------------------------------------------------------------

@dataclass(frozen=True)
class SpeedupEstimate(_Dict):
    """speedup = base/cand (> 1: candidate faster); CI on the speedup; log_ratio = ln(cand/base)."""

    speedup: float
    ci_low: float
    ci_high: float
    log_ratio: float
    half_width: float  # half the CI width of log_ratio: relative, 0.0025 is 0.25 %
    n_pairs: int
    method: str        # "<estimator>+<interval>", e.g. "hl+bca"; says when BCa fell back
    confidence: float = 0.95


def estimate_speedup(r: Sequence[float] | np.ndarray, confidence: float = 0.95, n_boot: int = 2000,
                     seed: int = 0, estimator: str = "hl", method: str = "rank") -> SpeedupEstimate:
    """Point estimate and CI of the speedup from per-pair log ratios ``r`` (at least 2)."""
    a = _vector(r, "log ratios", min_n=2)
    est = _estimator(estimator)
    _check_confidence(confidence)
    if method not in METHODS:
        raise ValueError(f"unknown CI method {method!r}; known: {', '.join(METHODS)}")
    if n_boot < 100 and method != "rank":
        raise ValueError(f"n_boot={n_boot} is too few bootstrap resamples for a CI; use >= 100 (2000 is usual)")
    theta = est.point(a)
    if method == "rank" or a.size < MIN_BOOTSTRAP_PAIRS:
        lo, hi = _rank_interval(a, est, confidence)
        used = "rank"
    else:
        boot, jack = _boot_and_jack(a, est, n_boot, np.random.default_rng(seed), method == "bca")
        lo, hi, used = _interval(theta, boot, None if jack is None else [jack], confidence)
    return SpeedupEstimate(speedup=math.exp(-theta), ci_low=math.exp(-hi), ci_high=math.exp(-lo),
                           log_ratio=theta, half_width=(hi - lo) / 2, n_pairs=int(a.size),
                           method=f"{est.name}+{used}", confidence=confidence)
