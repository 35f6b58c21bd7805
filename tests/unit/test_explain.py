"""What explains a win (flaloop/diagnose/explain.py) and a no-go's measured bound (flaloop/loop/bounds.py), as
pure functions over kernel tables and run records: honest wins pass, planted mismatches block."""

from __future__ import annotations

import json
import math

import pytest

from flaloop.diagnose import explain
from flaloop.loop import bounds, rules
from flaloop.loop.store import Iteration
from flaloop.stats import summarize

GREEN = {"green": True, "signal_only": False}


def side(kernels: dict[str, tuple[float, float]], steps: list[float] | None = None) -> dict:
    """A profile_step cell table: {name: (ms per step, launches per step)}."""
    ks = [{"name": n, "ms": ms, "launches": la} for n, (ms, la) in kernels.items()]
    total = sum(k["ms"] for k in ks)
    return {"kernels": ks, "steps": 10, "step_ms": steps or [total * (1 + 0.001 * (i % 3 - 1)) for i in range(10)],
            "device_ms": total, "launches": sum(k["launches"] for k in ks)}


def measured(cid: str, base_ms: float, cand_ms: float) -> dict:
    sp = base_ms / cand_ms
    return {"id": cid, "verdict": "FASTER" if sp > 1.01 else "SAME", "base_ms": base_ms, "cand_ms": cand_ms,
            "speedup": sp, "ci_low": sp * 0.995, "ci_high": sp * 1.005}


BASE = {"fwd_h": (0.50, 2), "wy_repr": (0.30, 2), "bwd_dqkw": (0.60, 1), "bwd_dv": (0.20, 1)}


def test_an_honest_win_is_explained_by_its_kernels():
    """Intermediates kept: fwd_h and wy_repr run once instead of twice (fewer launches, still there)."""
    cand = {"fwd_h": (0.25, 1), "wy_repr": (0.15, 1), "bwd_dqkw": (0.60, 1), "bwd_dv": (0.20, 1)}
    doc = explain.account({"base": {"c": side(BASE)}, "cand": {"c": side(cand)}}, [measured("c", 1.62, 1.22)])
    assert not doc["blocked"], doc["findings"]
    cell = doc["cells"][0]
    assert cell["checked"] and 0.9 < cell["share"] < 1.1
    assert {k["name"]: k["change"] for k in cell["kernels"]}["fwd_h"] == "kept"
    assert doc["total"]["share"] == pytest.approx(cell["share"])


def test_a_win_the_kernels_do_not_show_is_unexplained():
    """Measured 20 % faster, the kernels the same: the time went somewhere the profiler does not see."""
    doc = explain.account({"base": {"c": side(BASE)}, "cand": {"c": side(BASE)}}, [measured("c", 1.62, 1.35)])
    assert doc["blocked"]
    msgs = [f["message"] for f in doc["findings"]]
    assert any("below 50%" in m and m.startswith("c:") for m in msgs)
    assert all(f["rule"] == "unexplained-speedup" and f["blocking"] for f in doc["findings"])


def test_kernels_saving_far_more_than_measured_is_unexplained():
    cand = {"fwd_h": (0.05, 2), "wy_repr": (0.03, 2), "bwd_dqkw": (0.06, 1), "bwd_dv": (0.02, 1)}
    doc = explain.account({"base": {"c": side(BASE)}, "cand": {"c": side(cand)}}, [measured("c", 1.62, 1.45)])
    assert doc["blocked"] and any("above 150%" in f["message"] for f in doc["findings"])


def test_a_kernel_gone_with_nothing_doing_its_work_blocks_even_when_the_share_fits():
    cand = {"fwd_h": (0.50, 2), "bwd_dqkw": (0.60, 1), "bwd_dv": (0.20, 1)}  # wy_repr skipped outright
    doc = explain.account({"base": {"c": side(BASE)}, "cand": {"c": side(cand)}}, [measured("c", 1.62, 1.32)])
    assert doc["blocked"]
    assert any("wy_repr" in f["message"] and "nothing took over" in f["message"] for f in doc["findings"])


def test_a_fusion_adds_the_kernel_that_does_the_work():
    cand = {"fwd_h_wy_fused": (0.55, 2), "bwd_dqkw": (0.60, 1), "bwd_dv": (0.20, 1)}
    doc = explain.account({"base": {"c": side(BASE)}, "cand": {"c": side(cand)}}, [measured("c", 1.62, 1.37)])
    assert not doc["blocked"], doc["findings"]
    changes = {k["name"]: k["change"] for k in doc["cells"][0]["kernels"]}
    assert changes["fwd_h_wy_fused"] == "added" and changes["wy_repr"] == "removed"


def test_launch_gaps_saved_count_toward_the_explanation():
    """A launch-bound cell: the bench sees 20 us a launch beyond the kernels; dropping 10 launches
    saves 0.2 ms that no kernel's duration shows."""
    base = {"k": (0.010, 20)}
    cand = {"k": (0.005, 10)}
    doc = explain.account({"base": {"c": side(base)}, "cand": {"c": side(cand)}}, [measured("c", 0.41, 0.205)])
    cell = doc["cells"][0]
    assert cell["gap_ms"] == pytest.approx((0.41 - 0.01) / 20)
    assert not doc["blocked"] and 0.9 < cell["share"] < 1.1


def test_a_noisy_profile_does_not_block_and_says_how_noisy():
    steps = [1.6, 1.2, 2.0, 1.3, 1.9, 1.4, 1.8, 1.5, 1.7, 1.6]
    doc = explain.account({"base": {"c": side(BASE, steps)}, "cand": {"c": side(BASE, steps)}},
                          [measured("c", 1.62, 1.50)])
    cell = doc["cells"][0]
    assert cell["share_low"] < 0.5 < cell["share_high"] and not doc["blocked"]


def test_only_cells_that_won_are_held_to_the_share_and_unprofiled_cells_are_named():
    b_cand = {**BASE, "bwd_dv": (0.19, 1)}
    doc = explain.account({"base": {"a": side(BASE), "b": side(BASE)}, "cand": {"a": side(BASE), "b": side(b_cand)}},
                          [measured("a", 1.62, 1.62), {**measured("b", 1.62, 1.609), "ci_low": 1.004},
                           measured("z", 1.0, 0.5)])
    assert not doc["blocked"], doc["findings"]
    assert doc["total"]["cells"] == ["b"]  # no profiled cell won on its own: the total is over b, which got faster
    assert not any(c["checked"] for c in doc["cells"])
    assert doc["not_profiled"] == ["z"]
    assert "without a profile on both sides: z" in explain.go_missing(doc)[0][1]
    assert explain.go_missing({**doc, "not_profiled": []}) == []
    assert explain.go_missing({**doc, "not_profiled": [], "total": None})[0][0] == "explained win"


# -- the no-go's bound -------------------------------------------------------------------------------

def record_file(ws, name: str, cells: list[dict], aa: bool = False) -> str:
    """A run record with per-cell estimates, rooflines and eager samples, written under the workspace."""
    out = []
    for c in cells:
        summ = {"base": summarize([c["ms"]]).to_dict(), "cand": summarize([c["ms"]]).to_dict()}
        if c.get("host"):
            summ.update(host={"cand": summarize([c["host"]]).to_dict()},
                        eager={"cand": summarize([c["host"] * 1.02]).to_dict()})
        out.append({"cell": {"id": c["id"], "shape_name": c["id"].split("/")[0], "shape": {}, "mode": "fwd"},
                    "status": "ok", "verdict": "SAME", "launch_bound": bool(c.get("host")),
                    "estimate": {"speedup": 1.0, "ci_low": 1 - c.get("hw", 0.002), "ci_high": 1 + c.get("hw", 0.002),
                                 "log_ratio": 0.0, "half_width": c.get("hw", 0.002), "n_pairs": 16, "method": "hl+rank"},
                    "summary": summ,
                    "roofline": {"bytes": 1, "flops": 1, "floor_ms": c["ms"] * c["pct"] / 100, "pct_of_floor_cand": c["pct"],
                                 "pct_of_floor_base": c["pct"], "bound": "memory"} if c.get("pct") else None})
    d = ws / "runs" / name
    d.mkdir(parents=True)
    (d / "record.json").write_text(json.dumps({"op": "op", "created": "", "base": {"commit": "b" * 40},
                                               "candidate": {"commit": "b" * 40}, "config": {"margin": 0.005},
                                               "cells": out, "aa": aa}))
    return f"runs/{name}/record.json"


def loop_log(ws, cells: list[dict]) -> list[Iteration]:
    rel = record_file(ws, "aa", cells, aa=True)
    tried = Iteration(1, "bigger tiles", "noise", "c" * 40, "b" * 40, gate=GREEN,
                      vs_best={"complete": True, "record": rel})
    return [Iteration(0, "baseline", "baseline", "b" * 40, "b" * 40, gate=GREEN, baseline={"record": rel}), tried]


CELLS = [{"id": "S1/fwd", "ms": 1.0, "pct": 80.0, "hw": 0.02}, {"id": "S2/fwd", "ms": 0.01, "pct": 30.0, "host": 0.05}]


def test_a_bound_flaloop_measured_is_filled_in_and_checked(tmp_path):
    iters = loop_log(tmp_path, CELLS)
    ok = bounds.check(tmp_path, iters, "roofline@S1/fwd: streams K and V once", 1.3)
    assert ok.ok, ok.why
    assert "80.0% of its memory-bound roofline floor" in ok.text and "at most 1.250x left" in ok.text
    assert ok.text.endswith("(streams K and V once)") and ok.numbers["cell"] == "S1/fwd"
    assert rules.no_go_missing(iters, ok) == []
    assert not bounds.check(tmp_path, iters, "roofline@S1/fwd", 1.2).ok  # 1.25x left is more than 1.2x
    launch = bounds.check(tmp_path, iters, "launch", 1.2)
    assert launch.ok and launch.numbers["cell"] == "S2/fwd" and "host 0.05 ms > device 0.01 ms" in launch.text
    timer = bounds.check(tmp_path, iters, "timer", 1.01)  # needs +1 %, the bench resolves +-2 % on S1
    assert timer.ok and timer.numbers["cell"] == "S1/fwd"


@pytest.mark.parametrize(("text", "why"), [
    ("HBM bandwidth: 3.9 of 4.3 TB/s on B8_T2048", "not a limit flaloop measures"),  # free text, however precise
    ("", "name the limit"),
    ("roofline@S2/fwd", "does not bind"),          # at 30 % of the floor, 3.3x is left: more than the target needs
    ("roofline@S9/fwd", "no recorded roofline number on S9/fwd"),
    ("ncu-memory", "flaloop profile OP --ncu"),    # no Nsight Compute reading recorded: says what would back it
    ("timer@S1/fwd", "does not bind"),             # the target needs +20 %, far beyond what the A/A resolves
])
def test_a_bound_no_record_backs_is_refused_saying_what_would(tmp_path, text, why):
    iters = loop_log(tmp_path, CELLS)
    got = bounds.check(tmp_path, iters, text, 1.2)
    assert not got.ok and why in got.why, got.why
    assert [k for k, _ in rules.no_go_missing(iters, got)] == ["named bound"]
    assert math.isfinite(got.numbers["room"]) if got.numbers else True


def scaled(table: dict, load: float) -> dict:
    """A profile_step table taken while the host ran `load` times slower."""
    return {**table, "kernels": [{**k, "ms": k["ms"] * load} for k in table["kernels"]],
            "step_ms": [x * load for x in table["step_ms"]], "device_ms": table["device_ms"] * load}


def test_paired_rounds_explain_an_honest_win_whatever_the_load_of_each_round():
    """Each round profiles the two sides back to back: load that changes between rounds (or across
    one side's whole profile, as when the sides were taken one after the other) moves both halves
    of a round alike, and the savings are read at the bench's scale."""
    cand = {**BASE, "bwd_dqkw": (0.20, 1)}  # 0.4 ms of 1.6 saved, as measured
    b, c = side(BASE), side(cand)
    paired = explain.account({"base": {"c": [scaled(b, 1.0), scaled(b, 2.5)]},
                              "cand": {"c": [scaled(c, 1.0), scaled(c, 2.5)]}}, [measured("c", 1.6, 1.2)])
    cell = paired["cells"][0]
    assert not paired["blocked"] and not paired["unsure"]
    assert math.isclose(cell["share"], 1.0, rel_tol=0.02) and all(math.isclose(r, 1.0, rel_tol=0.02)
                                                                  for r in cell["round_shares"])
    # the same tables unpaired (the base profiled quiet, the candidate under 1.4x load) read 2%
    sequential = explain.account({"base": {"c": b}, "cand": {"c": scaled(c, 1.4)}}, [measured("c", 1.6, 1.2)])
    assert sequential["blocked"] and sequential["cells"][0]["share"] < 0.1


def test_a_bench_the_host_load_stretched_is_read_at_the_profiles_scale_only_where_the_profile_sees_the_whole_step():
    """On the host the profile sees the whole step (its host time is a row): a bench that ran 2.2x
    slower than the profile (the other half of a shared CPU busy) stretched its saving alike, so an
    honest win still fits. On a GPU the time beyond the kernels is launch gaps or unseen work, and the
    same numbers stay a refusal; a win no kernel shows is refused on the host too, stretched or not."""
    cand = {**BASE, "bwd_dqkw": (0.20, 1)}  # 0.4 ms of 1.6 saved
    stretched = [measured("c", 1.6 * 2.2, 1.2 * 2.2)]
    tables = {"base": {"c": [side(BASE), side(BASE)]}, "cand": {"c": [side(cand), side(cand)]}}
    host = explain.account(tables, stretched, whole_step=True)
    assert not host["blocked"] and not host["unsure"], host["findings"]
    assert math.isclose(host["cells"][0]["share"], 1.0, rel_tol=0.02) and host["cells"][0]["gap_ms"] == 0.0
    gpu = explain.account(tables, stretched)
    assert gpu["blocked"] and "below 50%" in gpu["findings"][0]["message"]
    none = explain.account({"base": {"c": [side(BASE), side(BASE)]}, "cand": {"c": [side(BASE), side(BASE)]}},
                           stretched, whole_step=True)
    assert none["blocked"] and "below 50%" in none["findings"][0]["message"]
    # the profile stretched instead (the bench quiet): scaled down on both, as before
    quiet = explain.account({"base": {"c": [scaled(side(BASE), 2.2)] * 2}, "cand": {"c": [scaled(side(cand), 2.2)] * 2}},
                            [measured("c", 1.6, 1.2)], whole_step=True)
    assert not quiet["blocked"] and math.isclose(quiet["cells"][0]["share"], 1.0, rel_tol=0.02)


def test_rounds_that_disagree_make_the_explanation_unsure_not_a_refusal():
    cand = {**BASE, "bwd_dqkw": (0.20, 1)}
    quiet, odd = side(cand), side({**BASE, "bwd_dqkw": (0.58, 1)})  # round 2's candidate step hit a stall
    doc = explain.account({"base": {"c": [side(BASE), side(BASE)]}, "cand": {"c": [quiet, odd]}},
                          [measured("c", 1.6, 1.2)])
    assert not doc["blocked"] and doc["unsure"] and "unsure, not refused" in doc["unsure"][0]
    assert "rounds: 100%, 5%" in doc["unsure"][0]
    from flaloop.report.markdown import explanation_md

    md = explanation_md({**doc, "steps": 10, "rounds": 2, "order": ["base then cand", "cand then base"], "kernels_are": "x"})
    assert "**Unsure (not refused):**" in md and "in 2 rounds with the sides back to back" in md
    # a win no round's kernels show is refused, paired or not
    none = explain.account({"base": {"c": [side(BASE), side(BASE)]}, "cand": {"c": [side(BASE), side(BASE)]}},
                           [measured("c", 1.6, 1.2)])
    assert none["blocked"] and "below 50%" in none["findings"][0]["message"]
