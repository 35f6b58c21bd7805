"""A bench cell reads the same wherever it is drawn: the view of a measured cell and of the same cell
stored in a run record agree, the report's row of it reads back as the same view, and each formatter
says "-" for nothing and keeps a tiny, a huge or a NaN number visible."""

from __future__ import annotations

import json
import math

import pytest

from flaloop.bench.model import Cell, CellResult, CellRoofline, CellSummary, Pair, RoundEstimate
from flaloop.guard.findings import Finding
from flaloop.report import fmt
from flaloop.report.cells import CellView
from flaloop.stats import Summary
from flaloop.stats.intervals import SpeedupEstimate


def _summary(median: float) -> Summary:
    return Summary(n=20, median=median, mean=median * 1.01, std=median / 50, min=median * 0.98,
                   p10=median * 0.99, p90=median * 1.02)


def _measured() -> CellResult:
    cell = Cell("s1", {"B": 2, "T": 256, "H": 4, "K": 64, "V": 64}, "fwdbwd", seqlens=(100, 412), l2="cold")
    pairs = [Pair("AB" if i % 2 else "BA", 1.2, 1.0, None, None) for i in range(20)]
    pairs[3] = Pair("AB", 9.0, 1.0, None, None, dropped="outlier")
    return CellResult(
        cell=cell, status="ok", timer="cuda_eager", pairs=pairs, verdict="FASTER", launch_bound=True,
        estimate=SpeedupEstimate(speedup=1.2, ci_low=1.15, ci_high=1.25, log_ratio=-0.18, half_width=0.02,
                                 n_pairs=19, method="hl+rank"),
        summary=CellSummary(base=_summary(1.2), cand=_summary(1.0),
                            eager={"base": _summary(1.5), "cand": _summary(1.3)}),
        rounds=[RoundEstimate(0, 10, 1.1, 1.05, 1.15), RoundEstimate(1, 9, 1.3, 1.25, 1.35)], rounds_disagree=True,
        tuning_differs=["kernel_a"], roofline=CellRoofline(bytes=10, flops=20, floor_ms=0.5, pct_of_floor_base=41.7,
                                                           pct_of_floor_cand=50.0, bound="memory"),
        findings=[Finding("numeric-tf32", "warn", "tf32 on", cell="s1/fwdbwd/l2-cold")])


def _refused() -> CellResult:
    return CellResult(cell=Cell("s2", {"B": 1, "T": 64}, "fwd"), status="refused", reason="out of memory")


def _stored(result: CellResult) -> dict:
    """The cell as record.json holds it (through JSON: tuples come back as lists)."""
    return json.loads(json.dumps(result.to_dict()))


@pytest.mark.parametrize("make", [_measured, _refused])
def test_the_view_of_a_cell_and_of_its_stored_record_agree(make):
    result = make()
    assert CellView.of(result) == CellView.from_record(_stored(result))


def test_the_report_row_reads_back_as_the_same_view():
    view = CellView.of(_measured())
    row = json.loads(json.dumps(view.to_dict()))
    assert list(row) == list(CellView.ROW)
    back = CellView.from_dict(row)
    assert all(getattr(back, k) == getattr(view, k) for k in CellView.ROW)


def test_what_a_measured_cell_reads():
    v = CellView.of(_measured())
    assert v.id == "s1/fwdbwd/l2-cold" and v.mode_label == "fwdbwd l2-cold" and v.varlen
    assert (v.ms("base"), v.ms("cand"), v.ms("base", eager=True), v.ms("cand", eager=True)) == (1.2, 1.0, 1.5, 1.3)
    assert v.pairs_label == "19/20" and v.findings == ("numeric-tf32",)
    assert v.note == ("launch-bound (host > device) eager timing (no CUDA graph) rounds differ beyond their CIs "
                      "(1.1000x, 1.3000x) autotune picked differently for 1 kernel key(s)")
    assert fmt.floor_share(v.floor["pct_of_floor_cand"], v.floor["above_100"]) == "50%"


def test_a_sweep_rows_cells_are_a_part_of_the_view():
    v = CellView.from_dict({"id": "s1/fwd", "speedup": None, "ci_low": None, "ci_high": None, "verdict": None,
                            "reason": "failed to set up"})
    assert not v.measured and v.ms("base") is None and v.floor == {}
    assert (fmt.speedup(v.speedup), fmt.interval(v.ci_low, v.ci_high), fmt.verdict_md(v.verdict, v.status)) == \
        ("-", "-", "-")
    refused = CellView.of(_refused())
    assert refused.note == "out of memory" and refused.pairs_label == "0/0"
    assert fmt.verdict_md(refused.verdict, refused.status) == "refused"


def test_formatters_say_dash_for_nothing():
    for f in (fmt.ms, fmt.pct, fmt.speedup, fmt.geomean, fmt.worst, fmt.launches, fmt.floor_share):
        assert f(None) == "-"
    assert fmt.interval(None, None) == "-" and fmt.interval(None, None, none="[-, -]") == "[-, -]"
    assert fmt.num(None, ".1f", none="?") == "?" and fmt.verdict_md(None) == "-"


def test_formatters_keep_tiny_huge_and_nan_visible():
    nan = math.nan
    assert fmt.ms(1e-9) == "0.0000" and fmt.ms(12345.678912) == "12345.6789"
    assert fmt.speedup(1e6) == "1000000.0000x" and fmt.speedup(1e-7) == "0.0000x"
    assert fmt.ms(nan) == "nan" and fmt.speedup(nan) == "nanx" and fmt.pct(nan) == "nan%"
    assert fmt.interval(1e-9, 1e9) == "[0.0000, 1000000000.0000]" and fmt.interval(nan, nan) == "[nan, nan]"
    assert fmt.pct(99.96) == "100.0%" and fmt.floor_share(120.4, True) == "120% (>100%!)"
    assert fmt.launches(3.0) == "3" and fmt.launches(2.5) == "2.5" and fmt.launches(1e9) == "1000000000"


def test_the_geomean_and_worst_cell_read_as_one_line():
    g = {"speedup": 1.08312, "ci_low": 1.07119, "ci_high": 1.09501}
    assert fmt.geomean(g) == "1.0831x [1.0712, 1.0950]" and fmt.geomean({}) == "-"
    assert fmt.worst({"id": "s1/fwd", "speedup": 0.98, "verdict": "SLOWER"}) == "s1/fwd 0.9800x SLOWER"
    assert fmt.worst({"id": "s1/fwd", "speedup": 0.98}) == "s1/fwd 0.9800x"
    assert fmt.tree_state("0123456789abcdef") == "0123456789ab"
    assert fmt.tree_state("0123456789abcdef", True, "d1ff") == "0123456789ab+dirty:d1ff"


def test_colours_and_emphasis_come_from_one_table():
    assert fmt.verdict_color("SLOWER") == fmt.VERDICT_COLORS["SLOWER"] and fmt.verdict_color(None) == fmt.GREY
    assert fmt.status_color("keep") == fmt.STATUS_COLORS["keep"] and fmt.status_color("unknown") == fmt.GREY
    assert fmt.status_style("drop") == "bold red" and fmt.status_style("baseline") == "bold"
    assert [fmt.verdict_md(v) for v in ("FASTER", "SLOWER", "SAME", "UNSURE")] == \
        ["**FASTER**", "**SLOWER**", "SAME", "UNSURE"]
    assert len(set(fmt.STATUS_COLORS.values())) == len(fmt.STATUS_COLORS)


def test_a_people_table_escapes_pipes():
    assert fmt.table(["a", "b"], [["x|y", 1]]) == ["| a | b |", "| --- | --- |", "| x\\|y | 1 |"]
