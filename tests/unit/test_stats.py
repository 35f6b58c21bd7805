"""flaloop.stats: known answers, input checks, and simulations of the verdicts people rely on.

The simulations draw per-sample log-normal noise (sigma 0.3 % unless stated) with a fixed
seed, so each rate is a deterministic number; bounds carry the binomial slack of the number
of runs where the true rate sits at the nominal level.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from flaloop import stats
from flaloop.stats import CIHalfWidthStop, SpeedupEstimate, Verdict, estimators, intervals

LAM = math.log1p(0.005)


def brute_hl(v: np.ndarray) -> float:
    i, j = np.triu_indices(len(v))
    return float(np.median((v[i] + v[j]) / 2))


def simulate(rng: np.random.Generator, effect: float, shape: tuple[int, ...], sigma: float = 0.003) -> np.ndarray:
    """Log ratios of pairs whose candidate is exp(effect) times the base, log-normal noise per sample."""
    base = np.exp(rng.normal(0.0, sigma, shape))
    cand = np.exp(effect + rng.normal(0.0, sigma, shape))
    return np.log(cand / base)


def est(lo: float, hi: float, point: float = 1.0) -> SpeedupEstimate:
    return SpeedupEstimate(speedup=point, ci_low=lo, ci_high=hi, log_ratio=-math.log(point),
                           half_width=(math.log(hi) - math.log(lo)) / 2, n_pairs=16, method="test")


# -- known answers -------------------------------------------------------------------------------

def test_summary_of_a_fixed_array():
    s = stats.summarize(np.arange(1.0, 11.0))
    assert s.n == 10 and s.median == 5.5 and s.mean == 5.5 and s.min == 1.0
    assert s.std == pytest.approx(math.sqrt(55 / 6))  # ddof=1: sum((x - 5.5)^2) = 82.5 over 9
    assert s.p10 == pytest.approx(1.9) and s.p90 == pytest.approx(9.1)  # linear interpolation
    one = stats.summarize([0.25])
    assert (one.n, one.std, one.median, one.p10, one.p90) == (1, 0.0, 0.25, 0.25, 0.25)


def test_hodges_lehmann_of_a_known_sample():
    # Walsh averages of 1, 2, 3, 10: 1 1.5 2 2 2.5 | 3 5.5 6 6.5 10 -> (2.5 + 3) / 2
    assert stats.hodges_lehmann([1.0, 2.0, 3.0, 10.0]) == 2.75
    assert stats.hodges_lehmann([0.0, 1.0]) == 0.5
    # one wild pair moves the mean by far more than the HL estimate
    r = np.array([0.001, -0.002, 0.0005, 0.0015, -0.001, 0.3])
    assert abs(stats.hodges_lehmann(r)) < 0.002 < abs(r.mean())


def test_log_ratio_sign_convention_candidate_half_as_fast():
    r = stats.log_ratios([2.0] * 20, [4.0] * 20)
    assert np.allclose(r, math.log(2))
    e = stats.estimate_speedup(r)
    assert e.speedup == pytest.approx(0.5) and e.log_ratio == pytest.approx(math.log(2))
    assert e.ci_low <= 0.5 <= e.ci_high
    assert stats.verdict(e) is Verdict.SLOWER
    twice = stats.estimate_speedup(stats.log_ratios([4.0] * 20, [2.0] * 20))
    assert twice.speedup == pytest.approx(2.0) and stats.verdict(twice) is Verdict.FASTER


def test_ci_is_inverted_onto_the_speedup_and_swapping_sides_swaps_the_verdict():
    r = simulate(np.random.default_rng(1), -0.01, (40,))  # candidate 1 % faster
    fwd, rev = stats.estimate_speedup(r), stats.estimate_speedup(-r)
    assert fwd.ci_low < fwd.speedup < fwd.ci_high
    assert fwd.speedup == pytest.approx(1 / rev.speedup)
    assert fwd.ci_low == pytest.approx(1 / rev.ci_high, rel=2e-3)  # resamples differ slightly
    assert stats.verdict(fwd) is Verdict.FASTER and stats.verdict(rev) is Verdict.SLOWER
    assert fwd.half_width == pytest.approx((math.log(fwd.ci_high) - math.log(fwd.ci_low)) / 2)


@pytest.mark.parametrize(("lo", "hi", "expected"), [
    (1.0051, 1.02, Verdict.FASTER),
    (1.005, 1.02, Verdict.UNSURE),            # touching the margin is not beyond it
    (0.98, 0.995, Verdict.SLOWER),            # 0.995 < 1/1.005 = 0.99502: slowdown 0.5025 % > 0.5 %
    (0.98, 1 / 1.005, Verdict.UNSURE),
    (0.9951, 1.0049, Verdict.SAME),
    (1 / 1.005, 1.0049, Verdict.UNSURE),      # inside means strictly inside
    (0.999, 1.006, Verdict.UNSURE),
    (0.99, 1.01, Verdict.UNSURE),
])
def test_verdict_rule_at_the_margin(lo, hi, expected):
    assert stats.verdict(est(lo, hi), margin=0.005) is expected


def test_verdict_margin_is_configurable():
    e = est(1.006, 1.008)
    assert stats.verdict(e, margin=0.005) is Verdict.FASTER
    assert stats.verdict(e, margin=0.01) is Verdict.SAME


def test_holm_on_hand_computed_pvalues():
    # sorted 0.005*4=0.02, 0.01*3=0.03, 0.03*2=0.06, 0.04*1 -> max(0.06, 0.04)=0.06
    adj = stats.holm_adjust([0.01, 0.04, 0.03, 0.005])
    assert np.allclose(adj, [0.03, 0.06, 0.06, 0.02])
    assert list(adj <= 0.05) == [True, False, False, True]
    assert np.allclose(stats.holm_adjust([0.02, 0.02]), [0.04, 0.04])
    assert np.allclose(stats.holm_adjust([0.9, 0.5]), [1.0, 1.0])


def test_rank_pvalues_are_the_exact_signed_rank_and_sign_tests():
    r = np.random.default_rng(2).normal(-0.007, 0.004, 14)
    p = stats.cell_pvalues(r, margin=0.005)
    w = lambda d, alt: sps.wilcoxon(d, alternative=alt, method="exact").pvalue  # noqa: E731
    assert p.faster == pytest.approx(w(r + LAM, "less"))
    assert p.slower == pytest.approx(w(r - LAM, "greater"))
    assert p.same == pytest.approx(max(w(r + LAM, "greater"), w(r - LAM, "less")))
    pm = stats.cell_pvalues(r, margin=0.005, estimator="median")
    assert pm.faster == pytest.approx(sps.binomtest(int((r + LAM < 0).sum()), r.size, 0.5, "greater").pvalue)


def test_bca_matches_scipy_bootstrap_given_the_same_generator():
    r = np.random.default_rng(3).normal(0.002, 0.004, 15)
    for name, statistic in (("hl", lambda a, axis=-1: np.apply_along_axis(brute_hl, axis, a)),
                            ("median", lambda a, axis=-1: np.median(a, axis=axis))):
        ref = sps.bootstrap((r,), statistic, n_resamples=999, method="BCa", rng=np.random.default_rng(7))
        e = stats.estimate_speedup(r, n_boot=999, seed=7, estimator=name, method="bca")
        assert e.method == f"{name}+bca"
        assert -math.log(e.ci_high) == pytest.approx(ref.confidence_interval.low, rel=1e-9, abs=1e-15)
        assert -math.log(e.ci_low) == pytest.approx(ref.confidence_interval.high, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("ties", [False, True])
def test_fast_bootstrap_hl_equals_brute_force_on_every_resample(ties):
    rng = np.random.default_rng(4)
    for n in (2, 3, 8, 21, 60):
        r = rng.normal(0, 1, n)
        x = np.sort(np.round(r) if ties else r)
        counts = np.vstack([intervals._resample_counts(n, 150, rng, np.arange(n)), 1 - np.eye(n, dtype=np.int64)])
        got = estimators._hl_resampled(x, counts)
        want = np.array([brute_hl(np.repeat(x, c)) for c in counts])
        assert np.array_equal(got, want), (n, ties)


def test_percentile_fallback_and_degenerate_samples():
    e = stats.estimate_speedup(np.full(30, 0.01), method="bca")
    assert e.method == "hl+percentile"  # BCa undefined on a degenerate bootstrap distribution
    assert e.ci_low == e.ci_high == pytest.approx(math.exp(-0.01)) and e.half_width == 0.0
    tiny = stats.estimate_speedup([0.001, -0.001, 0.002])  # too few pairs for any 95 % claim
    assert tiny.method == "hl+rank" and tiny.ci_low == 0.0 and tiny.ci_high == math.inf
    assert stats.verdict(tiny) is Verdict.UNSURE
    assert stats.estimate_speedup(np.arange(9.0), method="bca").method == "hl+rank"  # bootstrap undercovers below 10
    assert stats.estimate_speedup(np.arange(10.0), method="bca").method == "hl+bca"
    assert stats.estimate_speedup(np.arange(40.0)).method == "hl+rank"  # the default at every n


def test_same_seed_same_answer_other_seed_other_resamples():
    r = simulate(np.random.default_rng(5), 0.0, (30,))
    boot = dict(method="bca")
    assert stats.estimate_speedup(r, seed=11, **boot) == stats.estimate_speedup(r, seed=11, **boot)
    assert stats.estimate_speedup(r, seed=11, **boot).ci_low != stats.estimate_speedup(r, seed=12, **boot).ci_low
    assert stats.estimate_speedup(r, seed=11) == stats.estimate_speedup(r, seed=12)  # the rank default draws nothing


def test_single_cell_holm_is_the_rank_ci_rule():
    rng = np.random.default_rng(6)
    seen = set()
    for effect in np.linspace(-0.009, 0.009, 37):
        for n in (5, 8, 20):
            r = simulate(rng, effect, (n,))
            v = stats.verdict(stats.estimate_speedup(r, method="rank"))
            assert stats.holm_verdicts([r]) == [v], (effect, n)
            seen.add(v)
    assert seen == set(Verdict)


def test_holm_bootstrap_pvalues_agree_on_clear_cells_and_are_seeded():
    rng = np.random.default_rng(8)
    cells = [simulate(rng, e, (30,)) for e in (-0.02, 0.02, 0.0, 0.005)]
    assert stats.holm_verdicts(cells, test="bootstrap") == stats.holm_verdicts(cells) == [
        Verdict.FASTER, Verdict.SLOWER, Verdict.SAME, Verdict.UNSURE]
    p = stats.cell_pvalues(cells[0], test="bootstrap", n_boot=500)
    assert p.faster == 1 / 501  # never below 1 / (B + 1)
    assert stats.cell_pvalues(cells[3], test="bootstrap", seed=1) != stats.cell_pvalues(cells[3], test="bootstrap", seed=2)


def test_geomean_known_answer():
    cells = [np.full(20, math.log(0.5)), np.full(20, math.log(2.0)), np.zeros(20)]  # speedups 2, 0.5, 1
    g = stats.geomean(cells)
    assert g.speedup == pytest.approx(1.0) and g.ci_low == pytest.approx(1.0) and g.ci_high == pytest.approx(1.0)
    assert (g.worst_cell, g.n_regressions, g.n_cells) == (1, 1, 3)
    assert g.worst_speedup == pytest.approx(0.5)
    given = stats.geomean(cells, verdicts=[Verdict.SLOWER] * 3)
    assert given.n_regressions == 3


def test_geomean_joint_ci_is_scipys_multi_sample_bca():
    rng = np.random.default_rng(9)
    cells = [simulate(rng, e, (n,)) for e, n in ((0.004, 10), (-0.01, 12), (0.0, 8))]

    def joint(*samples, axis=-1):
        return np.mean([np.apply_along_axis(brute_hl, axis, s) for s in samples], axis=0)

    ref = sps.bootstrap(cells, joint, n_resamples=300, method="BCa", rng=np.random.default_rng(3))
    g = stats.geomean(cells, n_boot=300, seed=3, method="bca")
    assert g.method == "hl+bca"
    assert g.speedup == pytest.approx(math.exp(-np.mean([brute_hl(c) for c in cells])))
    assert -math.log(g.ci_high) == pytest.approx(ref.confidence_interval.low, rel=1e-9)
    assert -math.log(g.ci_low) == pytest.approx(ref.confidence_interval.high, rel=1e-9)


def test_results_serialise_to_plain_json():
    r = simulate(np.random.default_rng(10), 0.0, (20,))
    e = stats.estimate_speedup(r)
    d = {"est": e.to_dict(), "sum": stats.summarize(np.exp(r)).to_dict(),
         "geo": stats.geomean([r, -r]).to_dict(), "p": stats.cell_pvalues(r).to_dict(),
         "v": Verdict.SAME}
    back = json.loads(json.dumps(d))
    assert back["est"]["method"] == "hl+rank" and back["v"] == "SAME"
    assert isinstance(back["geo"]["worst_cell"], int) and back["sum"]["n"] == 20
    assert set(back["est"]) >= {"speedup", "ci_low", "ci_high", "log_ratio", "half_width", "n_pairs", "method"}


# -- input validation ----------------------------------------------------------------------------

@pytest.mark.parametrize(("base", "cand", "match"), [
    ([1.0, 2.0], [1.0], "paired one to one: got 2 base and 1 candidate"),
    ([1.0, 0.0], [1.0, 1.0], "base times must be positive.*index 1"),
    ([1.0, 1.0], [-1.0, 1.0], "candidate times must be positive.*index 0"),
    ([1.0, np.nan], [1.0, 1.0], "non-finite.*index 1"),
    ([1.0, 1.0], [np.inf, 1.0], "non-finite"),
    ([[1.0, 1.0]], [[1.0, 1.0]], "1-D"),
    ([], [], "at least 1"),
])
def test_log_ratios_rejects_bad_input(base, cand, match):
    with pytest.raises(ValueError, match=match):
        stats.log_ratios(base, cand)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: stats.estimate_speedup([0.1]), "at least 2"),
    (lambda: stats.estimate_speedup([0.1, np.nan]), "non-finite"),
    (lambda: stats.estimate_speedup([0.1, 0.2], estimator="mean"), "unknown estimator 'mean'"),
    (lambda: stats.estimate_speedup([0.1, 0.2], method="bc"), "unknown CI method"),
    (lambda: stats.estimate_speedup([0.1, 0.2], confidence=95), "confidence"),
    (lambda: stats.estimate_speedup([0.1, 0.2], n_boot=10, method="bca"), "n_boot"),
    (lambda: stats.summarize([]), "at least 1"),
    (lambda: stats.holm_verdicts([]), "no cells"),
    (lambda: stats.holm_verdicts([[0.1]]), "cell 0 .* at least 2"),
    (lambda: stats.holm_verdicts([[0.1, 0.2]], margin=-0.1), "margin"),
    (lambda: stats.holm_verdicts([[0.1, 0.2]], alpha=0), "alpha"),
    (lambda: stats.holm_verdicts([[0.1, 0.2]], test="t"), "unknown test"),
    (lambda: stats.holm_adjust([0.5, 1.5]), "p-values"),
    (lambda: stats.geomean([[0.1, 0.2]], verdicts=[]), "0 verdicts for 1 cells"),
])
def test_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- simulations ---------------------------------------------------------------------------------

def holm_runs(r: np.ndarray, margin: float = 0.005) -> np.ndarray:
    """Verdicts (runs, cells) as strings, Holm within each run."""
    return np.array([[v.value for v in stats.holm_verdicts(list(run), margin=margin)] for run in r])


def uncorrected_runs(r: np.ndarray, margin: float = 0.005) -> np.ndarray:
    return np.array([[stats.verdict(stats.estimate_speedup(c, method="rank"), margin).value for c in run]
                     for run in r])


def rate_bound(nominal: float, runs: int) -> float:
    return nominal + 3 * math.sqrt(nominal * (1 - nominal) / runs)


def test_aa_no_family_claims_a_difference():
    """(a) A/A, 12 cells x 40 pairs, 200 runs: runs with any FASTER/SLOWER <= 5 %."""
    r = simulate(np.random.default_rng(100), 0.0, (200, 12, 40))
    v = holm_runs(r)
    directional = np.isin(v, ["FASTER", "SLOWER"])
    family, per_cell = directional.any(axis=1).mean(), directional.mean()
    print(f"A/A margin 0.5 %: family-wise {family:.2%}, per cell {per_cell:.3%}, SAME {np.mean(v == 'SAME'):.1%}")
    assert family <= 0.05, f"{family:.1%} of A/A runs claimed a difference (per cell {per_cell:.2%})"
    assert np.mean(v == "SAME") >= 0.95  # and the noise is small enough to say so


def test_aa_with_zero_margin_holm_holds_the_family_rate_where_the_plain_ci_rule_does_not():
    """(a, stressed) margin 0: every FASTER/SLOWER in an A/A run is false."""
    r = simulate(np.random.default_rng(101), 0.0, (400, 12, 40))
    holm = np.isin(holm_runs(r, margin=0.0), ["FASTER", "SLOWER"])
    plain = np.isin(uncorrected_runs(r[:100], margin=0.0), ["FASTER", "SLOWER"])
    print(f"A/A margin 0: Holm family-wise {holm.any(axis=1).mean():.2%} (per cell {holm.mean():.3%}); "
          f"uncorrected 95 % CI family-wise {plain.any(axis=1).mean():.0%} (per cell {plain.mean():.2%})")
    assert holm.any(axis=1).mean() <= rate_bound(0.05, 400)
    assert plain.any(axis=1).mean() > 0.25  # the correction is what keeps the family rate down


def test_effect_exactly_at_the_margin_is_rarely_called_slower_or_same():
    """Least favourable case: slowdown == margin. SLOWER and SAME are both false claims."""
    r = simulate(np.random.default_rng(102), LAM, (400, 12, 40))
    v = holm_runs(r)
    slower, same = (v == "SLOWER").any(axis=1).mean(), (v == "SAME").any(axis=1).mean()
    print(f"at the margin: runs with a false SLOWER {slower:.2%}, with a false SAME {same:.2%}")
    assert slower <= rate_bound(0.025, 400) and same <= rate_bound(0.025, 400)
    assert not (v == "FASTER").any()


def test_one_percent_slowdown_is_detected():
    """(b) a true 1 % slowdown: SLOWER in >= 95 % of cells (Holm over 12 cells)."""
    r = simulate(np.random.default_rng(103), math.log(1.01), (100, 12, 40))
    v = holm_runs(r)
    print(f"1 % slowdown: SLOWER in {np.mean(v == 'SLOWER'):.1%} of cells")
    assert np.mean(v == "SLOWER") >= 0.95
    assert not (v == "FASTER").any()


@pytest.mark.parametrize("effect", [0.002, -0.002])
def test_effect_inside_the_margin_is_not_called_faster_or_slower(effect):
    """(c) a 0.2 % effect is inside the 0.5 % margin."""
    r = simulate(np.random.default_rng(104), effect, (100, 12, 40))
    v = holm_runs(r)
    called = np.mean(np.isin(v, ["FASTER", "SLOWER"]))
    print(f"{effect:+.1%} effect: FASTER/SLOWER in {called:.2%} of cells, SAME in {np.mean(v == 'SAME'):.1%}")
    assert called <= 0.05
    assert np.mean(v == "SAME") >= 0.9


@pytest.mark.parametrize(("estimator", "method", "n_cells"), [
    ("hl", "bca", 300), ("hl", "percentile", 150), ("median", "bca", 150), ("hl", "rank", 600),
])
def test_ci_covers_the_true_speedup(estimator, method, n_cells):
    """(d) coverage of the 95 % CI of one cell, 40 pairs, true slowdown 0.3 %."""
    effect = 0.003
    r = simulate(np.random.default_rng(105), effect, (n_cells, 40))
    es = [stats.estimate_speedup(c, estimator=estimator, method=method, seed=i) for i, c in enumerate(r)]
    covered = np.mean([e.ci_low <= math.exp(-effect) <= e.ci_high for e in es])
    print(f"{estimator}+{method}: coverage {covered:.1%} over {n_cells} cells")
    assert 0.90 <= covered <= 0.99


def test_geomean_joint_ci_covers_the_true_geomean():
    rng = np.random.default_rng(106)
    effects = np.linspace(-0.01, 0.01, 6)
    hits = []
    for run in range(80):
        cells = [simulate(rng, e, (30,)) for e in effects]
        g = stats.geomean(cells, n_boot=400, seed=run, method="bca")
        hits.append(g.ci_low <= math.exp(-effects.mean()) <= g.ci_high)
    print(f"geomean joint CI coverage {np.mean(hits):.1%}")
    assert np.mean(hits) >= 0.85


# -- one statistics story: the cell's interval and the geomean's cover alike ---------------------

COVERAGE_N = (6, 8, 10, 16, 32)


def _noise(rng: np.random.Generator, kind: str, size) -> np.ndarray:
    """Pair noise of ln(cand/base): normal, or heavy-tailed (Student t, 3 df) as a contended GPU gives."""
    return rng.normal(0, 0.01, size) if kind == "normal" else rng.standard_t(3, size) * 0.006


@pytest.mark.parametrize("kind", ["normal", "t3"])
def test_cell_and_geomean_intervals_cover_alike_at_every_n(kind):
    """Known truth, 600 replicates per n: the cell's rank interval, the geomean of that one cell
    and a geomean of three cells (unequal n and noise) all cover 95 % within sampling error
    (+-0.9 %) at n = 6, 8, 10, 16 and 32 pairs."""
    rng = np.random.default_rng(107)
    effects, reps = np.array([0.01, -0.02, 0.0]), 600
    for n in COVERAGE_N:
        cell = geo1 = geo3 = 0
        for _ in range(reps):
            r = 0.01 + _noise(rng, kind, n)
            e, g = stats.estimate_speedup(r), stats.geomean([r])
            assert (g.ci_low, g.ci_high) == pytest.approx((e.ci_low, e.ci_high), rel=1e-12)  # one cell: one interval
            cell += e.ci_low <= math.exp(-0.01) <= e.ci_high
            cells = [t + s * _noise(rng, kind, k) for t, k, s in zip(effects, (n, n + 4, 2 * n), (1, 2, 0.5), strict=True)]
            g3 = stats.geomean(cells)
            geo3 += g3.ci_low <= math.exp(-effects.mean()) <= g3.ci_high
        geo1 = cell
        print(f"{kind} n={n}: cell {cell / reps:.3f}, geomean of 1 {geo1 / reps:.3f}, of 3 {geo3 / reps:.3f}")
        for name, hits in (("cell", cell), ("geomean of 3", geo3)):
            assert 0.93 <= hits / reps <= 0.99, (kind, n, name, hits / reps)


def test_the_joint_bootstrap_undercovers_where_the_rank_story_does_not():
    """Why the bootstrap is no longer the default: one cell of 6 pairs, BCa geomean ~88 %."""
    rng = np.random.default_rng(108)
    hits = [(lambda g: g.ci_low <= math.exp(-0.01) <= g.ci_high)(
        stats.geomean([0.01 + _noise(rng, "normal", 6)], n_boot=400, seed=i, method="bca")) for i in range(300)]
    print(f"BCa geomean, one cell of 6 pairs: coverage {np.mean(hits):.1%}")
    assert np.mean(hits) < 0.925


def test_a_keep_cannot_rest_on_a_narrower_geomean_than_its_cell():
    """The CPU demo's case: one cell, 8 pairs, rank interval UNSURE -> the geomean is UNSURE too."""
    r = np.array([-0.35, -0.02, -0.3, -0.1, -0.45, 0.2, -0.25, -0.15])
    e, g = stats.estimate_speedup(r), stats.geomean([r])
    assert stats.verdict(e) is Verdict.UNSURE
    assert (g.ci_low, g.ci_high) == pytest.approx((e.ci_low, e.ci_high)) and g.ci_low < 1.005
    assert g.method == "hl+rank" and g.df == pytest.approx(7)


# -- stopping ------------------------------------------------------------------------------------

def feed(rule: CIHalfWidthStop, r: np.ndarray, seconds_per_pair: float = 0.01) -> int | None:
    """Pairs the rule asked for before saying stop (None: never stopped)."""
    for n in range(1, r.size + 1):
        if rule.enough(r[:n], n * seconds_per_pair):
            return n
    return None


def test_stops_at_min_pairs_when_noise_is_tiny():
    rule = CIHalfWidthStop(target=0.0025, min_pairs=16)
    assert feed(rule, simulate(np.random.default_rng(107), 0.01, (100,), sigma=0.0001)) == 16
    assert rule.reason.startswith("CI half-width") and "16 pairs" in rule.reason
    assert rule.last.half_width <= 0.0025


def test_keeps_sampling_when_noisy_and_stops_on_the_time_cap():
    r = simulate(np.random.default_rng(108), 0.0, (300,), sigma=0.03)
    rule = CIHalfWidthStop(target=0.0025, min_pairs=16, max_seconds=2.0)
    assert feed(rule, r, seconds_per_pair=0.01) == 200  # 200 pairs x 10 ms
    assert rule.reason.startswith("time cap") and "last CI half-width" in rule.reason
    assert rule.last.half_width > 0.0025


def test_time_cap_wins_over_min_pairs_and_pair_cap_stops():
    rule = CIHalfWidthStop(max_seconds=60.0)
    assert rule.enough(np.zeros(3), 61.0) and rule.reason.startswith("time cap")
    capped = CIHalfWidthStop(max_pairs=40, target=1e-9)
    assert feed(capped, simulate(np.random.default_rng(109), 0.0, (100,))) == 40
    assert capped.reason.startswith("pair cap")


def test_stops_close_to_an_every_pair_check_with_far_fewer_ci_evaluations(monkeypatch):
    r = simulate(np.random.default_rng(110), 0.0, (200,), sigma=0.008)
    first = next(n for n in range(16, 201) if stats.estimate_speedup(r[:n]).half_width <= 0.0025)
    assert first > 50  # far enough from min_pairs that the rule has checks to skip
    evaluated = []
    real = stats.estimate_speedup
    monkeypatch.setattr(stats, "estimate_speedup", lambda x, *a, **k: evaluated.append(len(x)) or real(x, *a, **k))
    got = feed(CIHalfWidthStop(target=0.0025), r)
    print(f"every-pair check stops at {first}; CIHalfWidthStop at {got} after {len(evaluated)} CI evaluations")
    assert first <= got <= math.ceil(1.1 * first)
    assert len(evaluated) < (got - 16) / 2


def test_a_rule_reused_on_a_new_cell_starts_afresh():
    rule = CIHalfWidthStop(max_seconds=1.0)
    assert rule.enough(np.zeros(20), 5.0)
    assert not rule.enough(np.zeros(3), 0.1) and rule.reason is None


def test_a_stopped_rule_serialises_with_its_reason_and_last_estimate():
    rule = CIHalfWidthStop()
    feed(rule, simulate(np.random.default_rng(111), 0.0, (40,), sigma=0.0001))
    d = json.loads(json.dumps(rule.to_dict()))
    assert d["reason"].startswith("CI half-width") and d["last"]["n_pairs"] == 16 and d["target"] == 0.0025


# -- the special functions, held to scipy.special's values ---------------------------------------

def test_the_t_quantile_is_scipys_to_ten_digits():
    from scipy import special

    from flaloop.stats.special import t_quantile

    for df in (0.5, 1, 1.5, 2, 3, 4.7, 7.3, 10, 31, 63.2, 100, 399, 1000, 5000, 1e5):
        for p in (0.001, 0.025, 0.05, 0.5, 0.6, 0.9, 0.95, 0.975, 0.99, 0.9995, 0.99999):
            want = special.stdtrit(df, p)
            assert t_quantile(df, p) == pytest.approx(want, rel=1e-10, abs=1e-12), (df, p)
    assert t_quantile(5, 0.0) == -math.inf and t_quantile(5, 1.0) == math.inf
    assert math.isnan(t_quantile(0, 0.9)) and math.isnan(t_quantile(5, 1.5))


def test_the_normal_and_binomial_functions_are_scipys():
    from scipy import special

    from flaloop.stats.special import binomial_half_cdf, ndtr, ndtri

    x = np.linspace(-8, 8, 401)
    assert np.allclose(ndtr(x), special.ndtr(x), rtol=1e-13, atol=0) and ndtr(0.0) == 0.5
    assert ndtr(x.reshape(1, -1)).shape == (1, 401)
    for p in (1e-9, 0.001, 0.025, 0.3, 0.5, 0.975, 1 - 1e-9):
        assert ndtri(p) == pytest.approx(special.ndtri(p), rel=1e-12, abs=1e-15)
    assert ndtri(0.0) == -math.inf and ndtri(1.0) == math.inf and math.isnan(ndtri(1.2))
    for n in (1, 6, 40, 400, 1000):
        assert np.allclose(binomial_half_cdf(n), special.bdtr(np.arange(n + 1), n, 0.5), rtol=1e-10, atol=0)
    assert binomial_half_cdf(2).tolist() == [0.25, 0.75, 1.0]
