"""Paired-sample statistics: summaries, speedup estimates with CIs, verdicts, geomean.

Pure functions over numbers (numpy, and four special functions in `special`): nothing here measures, reads files or
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
  95 %. Simulated with known truth (tests/unit/test_stats.py) it covers 94-98 % at n = 6 to 32, normal
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
*A new stopping rule* is any object with ``enough(r, elapsed_s) -> bool``, a ``reason``
attribute (``None`` until it says stop) and ``last`` (its latest interval, or ``None``); see
``StoppingRule``. Its class, or any ``RuleFactory``, is passed to the session
(``bench/session.Session(stopping=...)``, where the default is picked); the session asks it
after every pair and records ``reason``; nothing else needs to change.

*A new estimator* is an ``Estimator`` added to ``ESTIMATORS``: ``point(r)`` gives the
estimate; ``resampled(x, counts)`` gives it for each row of ``counts``, a multiset over the
sorted sample ``x`` (bootstrap resamples and jackknife samples are both passed this way, so
make it vectorised); ``rank_values(r)`` and ``rank_null_cdf(n)`` define the rank interval
and tests (the sorted values whose order statistics bound ``theta``, and the null CDF of
"how many of them exceed theta"). Every function taking ``estimator=`` then accepts it.
"""

from __future__ import annotations

from flaloop.stats.base import Summary, log_ratios, summarize
from flaloop.stats.estimators import ESTIMATORS, Estimator, hodges_lehmann
from flaloop.stats.geomean import GEOMEAN_METHODS, GeomeanEstimate, combined_interval, geomean
from flaloop.stats.intervals import (
    METHODS,
    MIN_BOOTSTRAP_PAIRS,
    SpeedupEstimate,
    estimate_speedup,
    shift_interval,
)
from flaloop.stats.stopping import CIHalfWidthStop, RuleFactory, StoppingRule
from flaloop.stats.verdicts import CellPValues, Verdict, cell_pvalues, holm_adjust, holm_verdicts, verdict

__all__ = [
    "ESTIMATORS", "GEOMEAN_METHODS", "METHODS", "MIN_BOOTSTRAP_PAIRS", "CIHalfWidthStop", "CellPValues",
    "Estimator", "GeomeanEstimate", "RuleFactory", "SpeedupEstimate", "StoppingRule", "Summary", "Verdict", "cell_pvalues",
    "combined_interval", "estimate_speedup", "geomean", "hodges_lehmann", "holm_adjust", "holm_verdicts",
    "log_ratios", "shift_interval", "summarize", "verdict",
]
