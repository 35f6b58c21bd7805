"""Autotune picks and rounds: what a worker reports Triton chose, how the session compares the
two sides, and how fresh-process rounds keep a per-process effect from becoming a verdict."""

from __future__ import annotations

import importlib
import sys

import pytest

from flaloop import stats as stats_mod
from flaloop.bench import analysis as session_mod
from flaloop.bench import model as model_mod
from flaloop.inside.worker import tuning as worker_mod

TUNED_KERNEL = '''
import torch
import triton
import triton.language as tl

CALLS = []


def fake_bench(kernel_call, quantiles=None):
    """Runs the kernel for real; says the second config benched is the faster one."""
    kernel_call()
    CALLS.append(1)
    t = 2.0 if len(CALLS) % 2 == 1 else 1.0
    return [t, t, t]


@triton.autotune(configs=[triton.Config({'BS': 16}), triton.Config({'BS': 32})], key=['n'], do_bench=fake_bench)
@triton.jit
def double(x, y, n, BS: tl.constexpr):
    o = tl.arange(0, BS)
    m = o < n
    tl.store(y + o, tl.load(x + o, mask=m) * 2, mask=m)


def run(n):
    x = torch.arange(n, dtype=torch.float32)
    y = torch.empty_like(x)
    double[(1,)](x, y, n)
    return y
'''


def test_worker_reports_each_autotuned_kernel_and_the_config_it_picked(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (tmp_path / "tuned_pkg_mod.py").write_text(TUNED_KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("tuned_pkg_mod")
    try:
        before = worker_mod.tuning_snapshot()
        assert "tuned_pkg_mod.double" not in before
        assert mod.run(8).tolist() == [2.0 * i for i in range(8)]
        added = worker_mod.tuning_added(before, worker_mod.tuning_snapshot())
        assert list(added) == ["tuned_pkg_mod.double"]
        ((key, config),) = added["tuned_pkg_mod.double"].items()
        assert "8" in key and "BS: 32" in config
        mod.run(8)  # same key: nothing new is tuned
        assert worker_mod.tuning_added(worker_mod.tuning_snapshot(), worker_mod.tuning_snapshot()) == {}
    finally:
        sys.modules.pop("tuned_pkg_mod", None)


def test_tuning_differences_names_kernels_tuned_by_both_sides_with_different_picks():
    base = {"m.k1": {"(64,)": "BS: 16", "(128,)": "BS: 32"}, "m.k2": {"(64,)": "BS: 64"}, "m.only_base": {"(1,)": "x"}}
    cand = {"m.k1": {"(64,)": "BS: 16", "(128,)": "BS: 64"}, "m.k2": {"(64,)": "BS: 64"}, "m.only_cand": {"(1,)": "y"}}
    assert session_mod.tuning_differences(base, cand) == ["m.k1 (128,): base [BS: 32] cand [BS: 64]"]
    assert session_mod.tuning_differences(base, base) == []


def _result(rounds: list[list[float]]) -> model_mod.CellResult:
    cell = model_mod.Cell("S", {"B": 1}, "fwd", "bfloat16")
    res = model_mod.CellResult(cell)
    for rnd, ratios in enumerate(rounds):
        for i, ratio in enumerate(ratios):
            res.pairs.append(model_mod.Pair("AB" if i % 2 == 0 else "BA", 1.0, ratio, None, None, round=rnd))
    return res


def test_rounds_that_disagree_are_flagged_and_rounds_that_agree_are_not():
    noise = [1.0, 1.001, 0.999, 1.0005, 0.9995, 1.0, 1.0002, 0.9998]
    agree = _result([[0.9 * x for x in noise], [0.9 * x for x in reversed(noise)]])
    rounds, disagree = session_mod.round_estimates(agree)
    assert not disagree and [r.round for r in rounds] == [1, 2]
    assert all(abs(r.speedup - 1 / 0.9) < 0.01 for r in rounds)
    split = _result([[0.99 * x for x in noise], [1.01 * x for x in noise]])
    rounds, disagree = session_mod.round_estimates(split)
    assert disagree and rounds[0].speedup > 1 > rounds[1].speedup
    assert session_mod.round_estimates(_result([noise])) == ([], False)


def test_a_verdict_stands_only_when_every_round_agrees_with_its_direction():
    noise = [1.0, 1.001, 0.999, 1.0005, 0.9995, 1.0, 1.0002, 0.9998]
    # the H200's start-order effect on top of a real 4% slowdown: rounds differ, both SLOWER
    planted = _result([[1.045 * x for x in noise], [1.035 * x for x in noise]])
    # a pooled win that one round of three does not show (3%, 3% and 0.4% faster)
    split = _result([[0.97 * x for x in noise], [0.97 * x for x in noise], [0.996 * x for x in noise]])
    steady = _result([[0.95 * x for x in noise], [0.95 * x for x in reversed(noise)]])
    for r in (planted, split, steady):
        r.status = "ok"
    session_mod.analyse([planted, split, steady], margin=0.005)
    assert stats_mod.holm_verdicts([split.log_ratios()])[0].value == "FASTER"  # what the pool alone says
    assert planted.rounds_disagree and planted.verdict == "SLOWER"
    assert split.verdict == "UNSURE" and "rounds disagree on the direction" in split.reason
    assert not steady.rounds_disagree and steady.verdict == "FASTER"
