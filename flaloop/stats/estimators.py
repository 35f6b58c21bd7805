"""Location estimators of the log ratios (Hodges-Lehmann, median), their vectorised resampled
forms (the exact Walsh-sum search) and the null distributions of their rank tests."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from flaloop.stats.base import _vector
from flaloop.stats.special import binomial_half_cdf, ndtr

EXACT_SIGNED_RANK_MAX_N = 400
GRID_PER_PAIR = 2  # Walsh-sum thresholds per pair in the bootstrap HL search (speed only)


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
        cdf = ndtr((t + 0.5 - m / 2) / sd)
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
    cdf = binomial_half_cdf(n)
    cdf.flags.writeable = False
    return cdf


@dataclass(frozen=True)
class Estimator:
    """A location estimator of the log ratios; flaloop.stats' docstring says how to add one."""

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
