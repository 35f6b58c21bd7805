"""When a cell has enough pairs: the stopping-rule protocol and the CI half-width rule."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from flaloop.stats.base import _Dict
from flaloop.stats.intervals import SpeedupEstimate, estimate_speedup

# -- stopping --------------------------------------------------------------------------------------

class StoppingRule(Protocol):
    """When a cell has enough pairs in a round: asked after every pair with the round's kept log
    ratios ln(cand/base) and the seconds the cell has taken; one instance per cell and round.

    ``reason`` says why it stopped (None while it has not). ``last`` is the latest interval it
    computed on the way (None before its first): the session judges a cell settled beyond the
    margin on it rather than bootstrapping a second one per pair. The session makes its rules with
    a `RuleFactory`; bench/session.Session's ``stopping`` picks the default, `CIHalfWidthStop`."""

    reason: str | None
    last: SpeedupEstimate | None

    def enough(self, r: np.ndarray, elapsed_s: float) -> bool: ...


class RuleFactory(Protocol):
    """Makes a cell's stopping rule for one round: the round's share of the half-width asked for,
    its pairs (at least, at most) and its seconds (bench/sampling.round_budget)."""

    def __call__(self, *, target: float, min_pairs: int, max_pairs: int, max_seconds: float) -> StoppingRule: ...


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

    target: float = 0.0025  # the CI half-width to reach (`to_dict` says `target`)
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
