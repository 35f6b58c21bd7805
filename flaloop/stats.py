"""Paired-sample statistics: summaries, speedup estimates with CIs, verdicts, geomean.

Pure functions over numbers (numpy and scipy only): nothing here measures, reads files or
keeps global state, so a report can recompute everything from a stored run record.

The method
----------
A cell is sampled as interleaved pairs (ABBA order), and each pair gives one statistic
``r = ln(t_cand / t_base)``. Drift common to both halves of a pair cancels in ``r``.

* **Estimate.** The location ``theta`` of ``r`` is estimated by the Hodges-Lehmann
  estimator (``"hl"``: median of the Walsh averages ``(r_i + r_j) / 2, i <= j``) or by the
  plain median (``"median"``). ``speedup = base / cand = exp(-theta)``: above 1 means
  the candidate is faster. Every bound on ``theta`` maps to the speedup the other way round
  (the upper bound on ``theta`` gives ``ci_low``).
* **Confidence interval** (``estimate_speedup(method=...)``): ``"rank"`` (default), the
  distribution-free interval dual to the rank test (the signed-rank test's order statistics of
  the Walsh averages for HL, the sign test's for the median). It needs symmetry of ``r`` about
  ``theta`` (true in an A/A comparison, since ``r`` is then a difference of exchangeable noises;
  close to true for a fixed speedup), is exact under it at every n and infinite below 6 pairs at
  95 %. Simulated with known truth (tests/test_stats.py) it covers 94-98 % at n = 6 to 32, normal
  and heavy-tailed noise alike; the bootstrap intervals undercover there (HL BCa: 88 % at n = 6,
  91-93 % at n = 10 to 24), which is why they are no longer the default. ``"bca"``: the BCa
  bootstrap with the formulas of ``scipy.stats.bootstrap`` (z0 from the "mean" percentile of
  score, acceleration from the jackknife, linear quantiles); given the same generator it
  reproduces ``scipy.stats.bootstrap(..., method="BCa")`` (a test checks this), in
  O(B n log n): a resample is held as a count vector over the sorted sample and its HL found
  exactly by bisection over a grid of Walsh sums (~30 ms for n = 200, B = 2000); below 10 pairs
  it falls back to the rank interval, and where BCa is not defined (a degenerate bootstrap
  distribution) to the percentile interval, and ``method`` says so. ``"percentile"``: the
  percentile bootstrap. Resampling is deterministic given ``seed``.
* **Verdict of one cell** (``verdict``): with ``lam = ln(1 + margin)`` the margin is
  symmetric in log space, so swapping base and candidate swaps FASTER and SLOWER.
  FASTER when ``ci_low > 1 + margin``; SLOWER when ``ci_high < 1 / (1 + margin)`` (a
  slowdown ``cand/base - 1`` above the margin); SAME when the CI lies strictly inside
  ``(1 / (1 + margin), 1 + margin)``; UNSURE otherwise (including a CI touching a bound).
* **Verdicts of a family of m cells** (``holm_verdicts``). For each cell three p-values
  (``cell_pvalues``), each from a one-sided test of a null hypothesis about ``theta``:

  - ``p_faster`` for H0: ``theta >= -lam`` (speedup <= 1 + margin);
  - ``p_slower`` for H0: ``theta <= +lam`` (slowdown <= margin);
  - ``p_same = max(p_lo, p_hi)``, the two one-sided tests (TOST, an intersection-union
    test) of H0: ``theta <= -lam`` and H0: ``theta >= +lam``.

  The default ``test="rank"`` uses the signed-rank test (HL) or the sign test (median),
  exact null distribution up to n = 400, continuity-corrected normal beyond; each p-value is
  valid whenever ``r - theta`` is symmetric about 0, whatever its shape. ``test="bootstrap"``
  uses ``(1 + #{theta* on the null side}) / (B + 1)`` from a percentile bootstrap instead
  (its smallest p-value is 1 / (B + 1), so B must exceed about 2 m / alpha).
  Holm's step-down procedure is applied separately to each of the three families, each at
  level ``alpha / 2``. A cell is FASTER, SLOWER or SAME when its hypothesis is rejected in
  that family, UNSURE otherwise (the three rejections exclude one another). Guarantees,
  under any dependence between cells (Holm needs none):
  P(any false FASTER) <= alpha/2, P(any false SLOWER) <= alpha/2, so the probability of
  any false FASTER-or-SLOWER claim in the family is <= alpha; P(any false SAME) <= alpha/2.
  (A bound on "any false claim of any kind" is 3 alpha / 2 by the union bound; pass
  ``alpha=2/3 * a`` for a.) With m = 1 and ``test="rank"`` the rule is exactly the
  single-cell CI rule applied to the 95 % rank interval (one-sided 2.5 % each side).
* **Stopping** (``CIHalfWidthStop``): stop a cell once the CI half-width, half the width
  of the CI of ``theta`` (0.0025 is 0.25 %), is at or below ``target`` with at least
  ``min_pairs`` pairs, or at a pair or time cap.
* **Aggregate** (``geomean``): the equal-weight geometric mean of the per-cell speedups,
  ``exp(-mean(theta_i))``. Its interval is built from the cells' own intervals, so both tell one
  story: each side of cell i's interval is read back as a standard error
  ``s_i = (theta_i - low_i) / t(0.975, n_i - 1)``, they add in quadrature over the mean, and the
  t quantile takes the Welch-Satterthwaite degrees of freedom of the ``s_i``. One cell's geomean
  interval is therefore exactly its own, and a keep can never rest on an interval narrower than
  the per-cell rule would trust; the coverage at n = 6 to 32 is the cells' (measured by the same
  test). ``method="bca"`` keeps the joint bootstrap for comparison. Beside it: the worst cell
  (lowest point speedup) and the number of SLOWER verdicts.

Extending
---------
*A new stopping rule* is any object with ``enough(r, elapsed_s) -> bool`` and a ``reason``
attribute (``None`` until it says stop); see ``StoppingRule``. The session asks it after
every pair and records ``reason``; nothing else needs to change.

*A new estimator* is an ``Estimator`` added to ``ESTIMATORS``: ``point(r)`` gives the
estimate; ``resampled(x, counts)`` gives it for each row of ``counts``, a multiset over the
sorted sample ``x`` (bootstrap resamples and jackknife samples are both passed this way, so
make it vectorised); ``rank_values(r)`` and ``rank_null_cdf(n)`` define the rank interval
and tests (the sorted values whose order statistics bound ``theta``, and the null CDF of
"how many of them exceed theta"). Every function taking ``estimator=`` then accepts it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import lru_cache
from typing import Protocol

import numpy as np


def _special():
    """scipy.special, imported on first use: every CLI command imports this module, few need scipy."""
    from scipy import special

    return special


def _scipy_stats():
    from scipy import stats

    return stats


__all__ = [
    "ESTIMATORS", "CIHalfWidthStop", "CellPValues", "Estimator", "GeomeanEstimate",
    "SpeedupEstimate", "StoppingRule", "Summary", "Verdict", "cell_pvalues", "estimate_speedup",
    "geomean", "hodges_lehmann", "holm_adjust", "holm_verdicts", "log_ratios", "summarize",
    "verdict",
]

METHODS = ("bca", "percentile", "rank")
EXACT_SIGNED_RANK_MAX_N = 400
MIN_BOOTSTRAP_PAIRS = 10  # below it bootstrap CIs undercover (HL BCa: 88 % at n = 6); rank CI used
GRID_PER_PAIR = 2  # Walsh-sum thresholds per pair in the bootstrap HL search (speed only)


def _plain(value: object) -> object:
    """JSON-able plain types for `to_dict`."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, _Dict):
        return value.to_dict()
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value)
    return value


class _Dict:
    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if not f.name.startswith("_")}


# -- input checks --------------------------------------------------------------------------------

def _vector(values: object, what: str, min_n: int = 1) -> np.ndarray:
    a = np.asarray(values, dtype=float)
    if a.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence of numbers, got shape {a.shape}")
    if a.size < min_n:
        raise ValueError(f"{what} needs at least {min_n} values, got {a.size}")
    bad = np.flatnonzero(~np.isfinite(a))
    if bad.size:
        raise ValueError(f"{what} has {bad.size} non-finite values (first at index {bad[0]}: {a[bad[0]]})")
    return a


def _cells(cells: Sequence[np.ndarray]) -> list[np.ndarray]:
    if len(cells) == 0:
        raise ValueError("no cells: pass one array of log ratios per cell")
    return [_vector(c, f"cell {i} log ratios", min_n=2) for i, c in enumerate(cells)]


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


# -- per-side summary ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Summary(_Dict):
    """One side of one cell: the final-claim block."""

    n: int
    median: float
    mean: float
    std: float
    min: float
    p10: float
    p90: float


def summarize(samples: Sequence[float] | np.ndarray) -> Summary:
    """n, median, mean, std (ddof=1; 0 for n < 2), min, p10, p90 (linear interpolation)."""
    a = _vector(samples, "samples")
    p10, p50, p90 = np.percentile(a, [10, 50, 90])
    std = float(np.std(a, ddof=1)) if a.size > 1 else 0.0
    return Summary(int(a.size), float(p50), float(a.mean()), std, float(a.min()), float(p10), float(p90))


def log_ratios(base: Sequence[float] | np.ndarray, cand: Sequence[float] | np.ndarray) -> np.ndarray:
    """Per-pair ``ln(t_cand / t_base)``; pair i is (base[i], cand[i])."""
    b, c = _vector(base, "base times"), _vector(cand, "candidate times")
    if b.size != c.size:
        raise ValueError(f"base and candidate must be paired one to one: got {b.size} base and "
                         f"{c.size} candidate times")
    for a, what in ((b, "base"), (c, "candidate")):
        bad = np.flatnonzero(a <= 0)
        if bad.size:
            raise ValueError(f"{what} times must be positive: {bad.size} are not (first at index "
                             f"{bad[0]}: {a[bad[0]]}); a time of zero or less is a timer bug")
    return np.log(c) - np.log(b)


# -- estimators ----------------------------------------------------------------------------------

def hodges_lehmann(r: Sequence[float] | np.ndarray) -> float:
    """Median of the Walsh averages ``(r_i + r_j) / 2`` over ``i <= j``."""
    a = _vector(r, "log ratios")
    i, j = np.triu_indices(a.size)
    return float(np.median((a[i] + a[j]) / 2))


@dataclass(frozen=True)
class _WalshGrid:
    """The Walsh sums of a sorted sample, sorted, with thresholds for counting them fast.

    A resample with counts c has Walsh multiset {x_a + x_b: a < b} with weight c_a c_b and
    {2 x_a} with weight c_a (c_a + 1) / 2. Since S[a, :] = x_a + x is sorted, the weight at or
    under a threshold t is (sum_a c_a C[g_t(a)] + C[d_t]) / 2, where C is the cumulative count
    and g_t(a), d_t are prefix lengths precomputed for the grid thresholds: O(n) per resample.
    """

    sums: np.ndarray   # sorted Walsh sums x_a + x_b, a <= b
    pa: np.ndarray     # their a
    pb: np.ndarray     # their b
    diag: np.ndarray   # int32 1 where a == b
    ends: np.ndarray   # grid: indices into `sums`, each the last of a run of equal values
    g: np.ndarray      # g[j, a] = #{b: x_a + x_b <= sums[ends[j]]}
    d: np.ndarray      # d[j] = #{a: 2 x_a <= sums[ends[j]]}

    @classmethod
    def build(cls, x: np.ndarray) -> _WalshGrid:
        n = x.size
        s = x[:, None] + x[None, :]  # computed once: S[a, b] == S[b, a] exactly
        pa, pb = np.triu_indices(n)
        order = np.argsort(s[pa, pb], kind="stable")
        pa, pb = pa[order], pb[order]
        sums = s[pa, pb]
        t = sums[np.linspace(0, sums.size - 1, min(sums.size, max(16, GRID_PER_PAIR * n))).round().astype(np.intp)]
        first, last = np.searchsorted(sums, t, "left"), np.searchsorted(sums, t, "right") - 1
        # a tie run of several sums is made a bracket of its own (resolved without a scan)
        ends = np.concatenate([first[first < last] - 1, last])
        ends = np.unique(ends[ends >= 0])
        g = np.stack([np.searchsorted(row, sums[ends], "right") for row in s], axis=1)
        d = np.searchsorted(np.diag(s).copy(), sums[ends], "right")
        return cls(sums, pa, pb, (pa == pb).astype(np.int32), ends, g, d)

    def kth(self, counts: np.ndarray, q1: np.ndarray, q2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The q1-th and q2-th smallest (1-based, q1 <= q2) Walsh sums of each row's multiset."""
        counter = _WalshCounter(self, counts)
        lo, hi = np.full(counts.shape[0], -1), np.full(counts.shape[0], self.ends.size - 1)
        at_hi = counter.total.copy()
        while (active := hi - lo > 1).any():
            mid = np.where(active, (lo + hi) // 2, hi)
            f = counter.count_le(mid)
            ok = active & (f >= q1)
            hi, lo, at_hi = np.where(ok, mid, hi), np.where(active & ~ok, mid, lo), np.where(ok, f, at_hi)
        below = np.where(lo >= 0, counter.count_le(np.maximum(lo, 0)), 0)
        start, stop = np.where(lo >= 0, self.ends[np.maximum(lo, 0)] + 1, 0), self.ends[hi]
        v1, v2 = self.sums[stop].copy(), self.sums[stop].copy()
        scan = np.flatnonzero(self.sums[start] != self.sums[stop])  # else the bracket is one value
        chunk = max(1, 2_000_000 // (int((stop - start)[scan].max(initial=0)) + 1))  # bound memory
        for k in range(0, scan.size, chunk):
            s = scan[k:k + chunk]
            v1[s], v2[s] = self._scan(counter.counts[s], q1[s] - below[s], q2[s] - below[s], start[s], stop[s])
        later = np.flatnonzero(at_hi < q2)  # the q2-th lies past this bracket (q1 ended it)
        if later.size:
            v2[later] = self.kth(counts[later], q2[later], q2[later])[0]
        return v1, v2

    def _scan(self, counts: np.ndarray, q1: np.ndarray, q2: np.ndarray, start: np.ndarray,
              stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Walk each row's bracket in order, summing weights up to the q1-th and q2-th sums."""
        idx = start[:, None] + np.arange(int((stop - start).max()) + 1)
        beyond = idx > stop[:, None]
        idx[beyond] = stop.min()  # any valid index: its weight is zeroed below
        flat, off = counts.ravel(), (np.arange(counts.shape[0]) * counts.shape[1])[:, None]
        ca, cb, dg = flat[self.pa[idx] + off], flat[self.pb[idx] + off], self.diag[idx]
        w = (ca * (cb + dg)) >> dg  # c_a c_b off the diagonal, c_a (c_a + 1) / 2 on it
        w[beyond] = 0
        cum = np.cumsum(w, axis=1)
        last = cum.shape[1] - 1
        p1 = np.argmax(cum >= q1[:, None], axis=1)
        p2 = np.where(cum[:, last] >= q2, np.argmax(cum >= q2[:, None], axis=1), last)
        rows = np.arange(idx.shape[0])
        return self.sums[idx[rows, p1]], self.sums[idx[rows, p2]]


class _WalshCounter:
    """Counts Walsh sums under grid thresholds for many count rows, in reused buffers.

    (Fresh multi-megabyte temporaries cost page faults that tripled the run time.)
    """

    def __init__(self, grid: _WalshGrid, counts: np.ndarray):
        rows, n = counts.shape
        # int32 halves the memory traffic of the gathers; sums stay below n^2 < 2^31
        self.grid, self.counts = grid, counts.astype(np.int32)
        self.cum = np.zeros((rows, n + 1), dtype=np.int32)
        np.cumsum(self.counts, axis=1, out=self.cum[:, 1:])
        size = self.cum[:, -1].astype(np.int64)
        self.total = size * (size + 1) // 2
        self.off = np.arange(rows) * (n + 1)
        self.idx = np.empty((rows, n), dtype=np.intp)
        self.val = np.empty((rows, n), dtype=np.int32)

    def count_le(self, j: np.ndarray) -> np.ndarray:
        """Weight of each row's Walsh sums at or under threshold j[row]."""
        flat = self.cum.ravel()
        np.take(self.grid.g, j, axis=0, out=self.idx)
        self.idx += self.off[:, None]
        np.take(flat, self.idx, out=self.val)
        ordered = np.einsum("ij,ij->i", self.counts, self.val).astype(np.int64)
        return (ordered + flat[self.off + self.grid.d[j]]) // 2


def _hl_resampled(x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Exact HL of every multiset ``repeat(x, counts[k])``; x sorted."""
    size = counts.sum(axis=1)
    m = size * (size + 1) // 2
    low, high = _WalshGrid.build(x).kth(counts, (m - 1) // 2 + 1, m // 2 + 1)
    return (low + high) / 4


def _median_resampled(x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    cum = np.cumsum(counts, axis=1)
    size = cum[:, -1:]
    i1 = (cum <= (size - 1) // 2).sum(axis=1)
    i2 = (cum <= size // 2).sum(axis=1)
    return (x[i1] + x[i2]) / 2


def _walsh_sorted(r: np.ndarray) -> np.ndarray:
    i, j = np.triu_indices(r.size)
    return np.sort((r[i] + r[j]) / 2)


@lru_cache(maxsize=64)
def _signed_rank_cdf(n: int) -> np.ndarray:
    """P(T <= t), t = 0..n(n+1)/2, T the signed-rank statistic of n symmetric values."""
    m = n * (n + 1) // 2
    t = np.arange(m + 1)
    if n > EXACT_SIGNED_RANK_MAX_N:
        sd = math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
        cdf = _special().ndtr((t + 0.5 - m / 2) / sd)
    else:
        pmf = np.zeros(m + 1)
        pmf[0] = 1.0
        for k in range(1, n + 1):  # T = sum of k * (sign_k > 0): convolve with (1 + z^k) / 2
            top = k * (k - 1) // 2 + 1
            shifted = pmf[:top].copy()
            pmf[:top + k] *= 0.5
            pmf[k:top + k] += 0.5 * shifted
        cdf = np.minimum(np.cumsum(pmf), 1.0)
    cdf.flags.writeable = False
    return cdf


@lru_cache(maxsize=64)
def _sign_cdf(n: int) -> np.ndarray:
    cdf = _scipy_stats().binom.cdf(np.arange(n + 1), n, 0.5)
    cdf.flags.writeable = False
    return cdf


@dataclass(frozen=True)
class Estimator:
    """A location estimator of the log ratios; see the module docstring to add one."""

    name: str
    point: Callable[[np.ndarray], float]
    resampled: Callable[[np.ndarray, np.ndarray], np.ndarray]
    rank_values: Callable[[np.ndarray], np.ndarray]
    rank_null_cdf: Callable[[int], np.ndarray]


ESTIMATORS: dict[str, Estimator] = {
    "hl": Estimator("hl", hodges_lehmann, _hl_resampled, _walsh_sorted, _signed_rank_cdf),
    "median": Estimator("median", lambda r: float(np.median(r)), _median_resampled, np.sort, _sign_cdf),
}


def _estimator(name: str) -> Estimator:
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; known: {', '.join(ESTIMATORS)}") from None


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
    z0 = _special().ndtri(((boot < theta).sum() + (boot <= theta).sum()) / (2 * boot.size))
    num = den = 0.0
    for jack in jacks:
        u = (jack.size - 1) * (jack.mean() - jack)
        num += (u ** 3).sum() / jack.size ** 3
        den += (u ** 2).sum() / jack.size ** 2
    a = num / (6 * den ** 1.5)
    z = _special().ndtri(alpha)
    return (float(_special().ndtr(z0 + (z0 + z) / (1 - a * (z0 + z)))),
            float(_special().ndtr(z0 + (z0 - z) / (1 - a * (z0 - z)))))


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


# -- stopping --------------------------------------------------------------------------------------

class StoppingRule(Protocol):
    """Asked after every pair; ``reason`` says why it stopped (None while it has not)."""

    reason: str | None

    def enough(self, r: np.ndarray, elapsed_s: float) -> bool: ...


@dataclass
class CIHalfWidthStop(_Dict):
    """Stop when the CI half-width of ln(cand/base) is <= target (after min_pairs), or at a cap.

    The caps win over min_pairs. The CI is not recomputed after every pair while it is far
    from the target: from the half-width h at n pairs, the next check comes after a third of
    the pairs that sqrt(n) scaling says are still needed, at least n // 50 and at most 10 % of
    n pairs later. So it stops at most ~10 % later than an every-pair check would, and a noisy
    cell at n = 1000 (one CI: its ~500k Walsh averages) is checked every 20 pairs, not every pair.
    One instance per cell; a shorter ``r`` than last time starts afresh.
    """

    target: float = 0.0025
    min_pairs: int = 16
    max_pairs: int = 2000
    max_seconds: float = 60.0
    confidence: float = 0.95
    estimator: str = "hl"
    method: str = "rank"
    n_boot: int = 2000
    seed: int = 0
    reason: str | None = field(default=None, init=False)
    last: SpeedupEstimate | None = field(default=None, init=False)
    _next_check: int = field(default=0, init=False, repr=False)
    _seen: int = field(default=0, init=False, repr=False)

    def enough(self, r: np.ndarray, elapsed_s: float) -> bool:
        n = len(r)
        if n < self._seen:
            self.reason, self.last, self._next_check = None, None, 0
        self._seen = n
        if elapsed_s >= self.max_seconds:
            return self._stop(f"time cap: {elapsed_s:.1f} s >= {self.max_seconds:g} s after {n} pairs")
        if n >= self.max_pairs:
            return self._stop(f"pair cap: {n} pairs >= {self.max_pairs}")
        if n < max(self.min_pairs, 2, self._next_check):
            return False
        self.last = estimate_speedup(r, self.confidence, self.n_boot, self.seed, self.estimator, self.method)
        hw = self.last.half_width
        if hw <= self.target:
            return self._stop(f"CI half-width {hw:.3%} <= {self.target:.3%} after {n} pairs")
        self._next_check = n + self._skip(n, hw)
        return False

    def _skip(self, n: int, hw: float) -> int:
        cap = math.ceil(0.1 * n)
        if self.target <= 0 or not math.isfinite(hw):
            return cap
        return max(1, n // 50, min(cap, int(n * ((hw / self.target) ** 2 - 1) / 3)))

    def _stop(self, reason: str) -> bool:
        if self.last is not None and not reason.startswith("CI"):
            reason += f"; last CI half-width {self.last.half_width:.3%} (target {self.target:.3%})"
        self.reason = reason
        return True


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


def _combined_interval(thetas: np.ndarray, bounds: list[tuple[float, float]], ns: list[int],
                       confidence: float) -> tuple[float, float, float]:
    """(low, high, df) for mean(theta_i) from each cell's own interval (low_i, high_i) on n_i pairs.

    Each side of a cell's interval is read back as a standard error, ``s = (theta - low) / t(n - 1)``,
    the errors add in quadrature over the mean, and the t quantile takes the Welch-Satterthwaite
    degrees of freedom. With one cell this returns that cell's interval exactly.
    """
    if any(not (math.isfinite(lo) and math.isfinite(hi)) for lo, hi in bounds):
        return -math.inf, math.inf, float(min(ns) - 1)
    t = _scipy_stats().t
    p = (1 + confidence) / 2
    q = np.array([t.ppf(p, n - 1) for n in ns])
    s_lo = (thetas - np.array([b[0] for b in bounds])) / q
    s_hi = (np.array([b[1] for b in bounds]) - thetas) / q
    m = thetas.size
    s = (s_lo + s_hi) / 2
    den = float(np.sum(s ** 4 / (np.array(ns) - 1)))
    df = float(np.sum(s ** 2) ** 2 / den) if den > 0 else float(min(ns) - 1)
    qq = float(t.ppf(p, df))
    center = float(thetas.mean())
    return (center - qq * math.sqrt(float(np.sum(s_lo ** 2))) / m,
            center + qq * math.sqrt(float(np.sum(s_hi ** 2))) / m, df)


def geomean(cells: Sequence[np.ndarray], verdicts: Sequence[Verdict] | None = None, confidence: float = 0.95,
            n_boot: int = 2000, seed: int = 0, estimator: str = "hl", margin: float = 0.005,
            alpha: float = 0.05, method: str = "rank") -> GeomeanEstimate:
    """Geomean speedup over cells; verdicts (default: holm_verdicts) give n_regressions.

    ``method="rank"`` (default) builds the interval from the cells' own rank intervals
    (``_combined_interval``): one cell's geomean interval is that cell's interval, so a keep never
    rests on a narrower interval than the per-cell rule trusts, and the coverage is the cells'
    (tests/test_stats.py measures it at n = 6 to 32). ``method="bca"``: the joint bootstrap (each
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
        lo, hi, df = _combined_interval(thetas, bounds, [max(2, c.size) for c in cs], confidence)
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
