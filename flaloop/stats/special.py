"""The four special functions the statistics use, in plain Python: the normal CDF and quantile, the
binomial CDF at p = 1/2 and the Student t quantile.

scipy.special has them all, but importing it cost every bench, compare, sweep and iter 0.22-0.33 s
on the 2-core development machine (docs/lab/2026-12-04-cpu.md R30). tests/unit/test_stats.py holds
each of these to scipy's values.
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

import numpy as np

_NORMAL = NormalDist()


def ndtr(x):
    """The standard normal CDF, of a number or elementwise of an array (scipy.special.ndtr)."""
    def one(v: float) -> float:
        return 0.5 * math.erfc(-v / math.sqrt(2.0))

    if np.ndim(x) == 0:
        return one(float(x))
    return np.array([one(float(v)) for v in np.ravel(x)]).reshape(np.shape(x))


def ndtri(p: float) -> float:
    """The standard normal quantile (scipy.special.ndtri): -inf at 0, inf at 1, nan outside."""
    p = float(p)
    if math.isnan(p) or not 0.0 <= p <= 1.0:
        return math.nan
    if p == 0.0:
        return -math.inf
    if p == 1.0:
        return math.inf
    return _NORMAL.inv_cdf(p)


def binomial_half_cdf(n: int) -> np.ndarray:
    """P(X <= k) for k = 0..n, X ~ Binomial(n, 1/2) (scipy.special.bdtr(k, n, 0.5)), from exact
    integer counts: the k-th value is (C(n, 0) + ... + C(n, k)) / 2**n, rounded once."""
    total, counts = 0, []
    for k in range(n + 1):
        total += math.comb(n, k)
        counts.append(total)
    return np.array([c / 2 ** n for c in counts])


def _betainc_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-16
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((a + m2 - 1.0) * (a + m2)),
                    -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; else by symmetry
        return front * _betainc_fraction(a, b, x) / a
    return 1.0 - front * _betainc_fraction(b, a, 1.0 - x) / b


def _t_upper(t: float, df: float) -> float:
    """P(T > t) for t >= 0, T ~ Student t with df degrees of freedom."""
    return 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))


def _t_density(t: float, df: float) -> float:
    return math.exp(math.lgamma((df + 1.0) / 2.0) - math.lgamma(df / 2.0) - 0.5 * math.log(df * math.pi)
                    - (df + 1.0) / 2.0 * math.log1p(t * t / df))


@lru_cache(maxsize=4096)
def t_quantile(df: float, p: float) -> float:
    """The Student t quantile (scipy.special.stdtrit(df, p)): the t with P(T <= t) = p. Newton's
    method on the upper tail (which keeps its precision where p is near 1) from the normal
    quantile's Cornish-Fisher correction, held inside a bracket that bisection shrinks whenever a
    step would leave it."""
    df, p = float(df), float(p)
    if math.isnan(df) or math.isnan(p) or df <= 0.0 or not 0.0 <= p <= 1.0:
        return math.nan
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(df, 1.0 - p)
    if p == 1.0:
        return math.inf
    tail = 1.0 - p
    lo, hi = 0.0, 1.0
    while _t_upper(hi, df) > tail:
        lo, hi = hi, hi * 2.0
        if hi > 1e300:
            return math.inf
    z = ndtri(p)
    t = z + (z ** 3 + z) / (4.0 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96.0 * df * df)
    if not lo < t < hi:
        t = (lo + hi) / 2.0
    for _ in range(200):
        excess = _t_upper(t, df) - tail  # > 0: t is below the quantile
        if excess > 0:
            lo = t
        else:
            hi = t
        step = excess / max(_t_density(t, df), 1e-300)
        nxt = t + step
        if not lo < nxt < hi:
            nxt = (lo + hi) / 2.0
        if nxt == t or abs(nxt - t) <= 4e-16 * abs(t):
            return nxt
        t = nxt
    return t
