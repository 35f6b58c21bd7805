"""The stopping rule is a seam: the session's rounds take whatever rule its factory makes, and
the CI half-width rule is the default in one place (bench/session.Session)."""

from __future__ import annotations

import inspect
import math

import numpy as np

from flaloop.bench.model import BenchConfig
from flaloop.bench.sampling import round_budget
from flaloop.bench.session import Session
from flaloop.stats import CIHalfWidthStop


class EveryTenPairs:
    """A rule of another kind: enough after ten pairs, whatever they say."""

    def __init__(self, *, target: float, min_pairs: int, max_pairs: int, max_seconds: float):
        self.budget = dict(target=target, min_pairs=min_pairs, max_pairs=max_pairs, max_seconds=max_seconds)
        self.reason, self.last = None, None

    def enough(self, r: np.ndarray, elapsed_s: float) -> bool:
        if len(r) >= 10:
            self.reason = "ten pairs"
        return self.reason is not None


def test_a_round_takes_the_rule_its_factory_makes_with_the_rounds_share_of_the_budget():
    cfg = BenchConfig(rounds=4, min_pairs=16, max_pairs=400, half_width=0.0025, cell_seconds=60.0)
    lo, hi, rule = round_budget(cfg, 0, 0, EveryTenPairs)
    assert isinstance(rule, EveryTenPairs) and (lo, hi) == (4, 100)
    assert rule.budget == {"target": 0.0025 * math.sqrt(4), "min_pairs": 4, "max_pairs": 100, "max_seconds": 15.0}
    assert not rule.enough(np.zeros(9), 0.0) and rule.enough(np.zeros(10), 0.0) and rule.reason == "ten pairs"
    # later rounds take as many pairs as round 1 kept
    assert round_budget(cfg, 1, 12, EveryTenPairs)[:2] == (12, 12)


def test_the_session_picks_the_ci_half_width_rule_unless_given_another():
    assert inspect.signature(Session).parameters["stopping"].default is CIHalfWidthStop
    lo, hi, rule = round_budget(BenchConfig(rounds=1), 0, 0, CIHalfWidthStop)
    assert isinstance(rule, CIHalfWidthStop) and rule.last is None and rule.reason is None
    assert (rule.min_pairs, rule.max_pairs) == (lo, hi)
