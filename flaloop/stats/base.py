"""What every part of stats shares: plain-JSON dataclasses, input checks, per-side summaries,
log ratios."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import Enum

import numpy as np


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
