"""The loop's rules as pure functions over fake records: statuses, stall, stop and no-go, the
dispatch condition language, and the markdown documents that round-trip and keep the user's notes."""

from __future__ import annotations

import math

import pytest

from flaloop.bench.record import RunRecord
from flaloop.core.errors import UsageError
from flaloop.core.workspace import Workspace
from flaloop.loop import bounds, records, rules, traps
from flaloop.loop.condition import Condition, bucket
from flaloop.loop.store import Decision, DispatchRow, Iteration
from flaloop.stats import summarize

GREEN = {"green": True, "signal_only": False, "counts": {"passed": 2, "selected": 2}, "reasons": []}
RED = {"green": False, "signal_only": False, "counts": {"passed": 1, "selected": 2},
       "reasons": ["pytest-exit: pytest exited 1 (tests failed)"]}


def bench_record(cells: list[tuple[str, str, float, float]], geo: tuple[float, float, float] | None = None,
                 *, guard: dict | None = None, errors: list[str] | None = None, base: str = "b" * 40) -> RunRecord:
    """A run record as bench() writes it: cells of (id, verdict, ci_low, ci_high)."""
    out = []
    for cid, verdict, lo, hi in cells:
        shape, mode = cid.split("/")
        measured = verdict in rules.MEASURED
        sp = (lo * hi) ** 0.5
        out.append({"cell": {"id": cid, "shape_name": shape, "shape": {}, "mode": mode}, "verdict": verdict,
                    "reason": "" if measured else f"{verdict.lower()} here",
                    "estimate": {"speedup": sp, "ci_low": lo, "ci_high": hi, "log_ratio": -math.log(sp),
                                 "half_width": 0.001, "n_pairs": 16, "method": "hl+bca"} if measured else None,
                    "summary": {"base": summarize([2.0]).to_dict(), "cand": summarize([1.0]).to_dict()}
                    if measured else {}})
    rec = {"op": "op", "created": "", "base": {"commit": base}, "candidate": {"commit": "c" * 40},
           "config": {"margin": 0.005}, "cells": out, "errors": errors or [],
           "summary": {"geomean": None if geo is None else {
               "speedup": geo[0], "ci_low": geo[1], "ci_high": geo[2], "worst_cell_id": cells[0][0],
               "worst_speedup": geo[0], "worst_cell": 0, "n_regressions": 0, "n_cells": len(cells)}}}
    if guard is not None:
        rec["guard"] = guard
    return RunRecord.from_dict(rec)


def status_of(cells, geo, *, gate=GREEN, guard_blocked=False, signal=False, **kw) -> str:
    cmp = rules.compare(bench_record(cells, geo, **kw), "runs/x/record.json")
    return rules.decide(gate=gate, guard_blocked=guard_blocked, guard_reason="rule at f.py:3: x", vs_best=cmp,
                        signal=signal).status


A, B = "S1/fwd", "S2/fwd"


@pytest.mark.parametrize("cells, geo, kw, expected", [
    # FASTER beyond the margin on the geomean and no cell SLOWER: keep
    ([(A, "FASTER", 1.1, 1.2), (B, "SAME", 0.999, 1.001)], (1.05, 1.02, 1.08), {}, "keep"),
    # the geomean CI is above 1 but not above 1 + margin: UNSURE, so noise
    ([(A, "UNSURE", 1.0, 1.02), (B, "UNSURE", 1.0, 1.02)], (1.01, 1.001, 1.02), {}, "noise"),
    ([(A, "SAME", 0.999, 1.001), (B, "SAME", 0.999, 1.001)], (1.0, 0.999, 1.001), {}, "noise"),
    # a faster geomean with one SLOWER cell is a regression: revert
    ([(A, "FASTER", 1.5, 1.6), (B, "SLOWER", 0.9, 0.95)], (1.2, 1.1, 1.3), {}, "revert"),
    ([(A, "SLOWER", 0.5, 0.6), (B, "UNSURE", 0.9, 1.05)], (0.7, 0.6, 0.8), {}, "revert"),
    # a signal iteration is never keep, however fast
    ([(A, "FASTER", 1.5, 1.6), (B, "FASTER", 1.5, 1.6)], (1.55, 1.5, 1.6), {"signal": True}, "signal"),
    # red gate, guard block, a blocked cell, a failed cell, a worker error: drop
    ([(A, "FASTER", 1.5, 1.6)], (1.55, 1.5, 1.6), {"gate": RED}, "drop"),
    ([(A, "FASTER", 1.5, 1.6)], (1.55, 1.5, 1.6), {"guard_blocked": True}, "drop"),
    ([(A, "BLOCKED", 0, 0), (B, "FASTER", 1.5, 1.6)], (1.55, 1.5, 1.6), {}, "drop"),
    ([(A, "FAILED", 0, 0), (B, "FASTER", 1.5, 1.6)], (1.55, 1.5, 1.6), {}, "drop"),
    ([(A, "FASTER", 1.5, 1.6)], (1.55, 1.5, 1.6), {"errors": ["the cand worker died"]}, "drop"),
    ([(A, "FASTER", 1.5, 1.6)], (1.55, 1.5, 1.6), {"guard": {"blocked": True, "findings": []}}, "drop"),
    # a bench guard entry that blocks nothing does not matter
    ([(A, "FASTER", 1.5, 1.6)], (1.55, 1.5, 1.6), {"guard": {"blocked": False, "findings": []}}, "keep"),
])
def test_status_follows_the_verdicts(cells, geo, kw, expected):
    assert status_of(cells, geo, **kw) == expected


def test_no_bench_and_no_gate_are_drops_with_reasons():
    out = rules.decide(gate=None, guard_blocked=False, guard_reason="", vs_best=None, signal=False)
    assert out.status == "drop" and "gate red" in out.reason
    out = rules.decide(gate=GREEN, guard_blocked=True, guard_reason="numeric-tf32 at chunk.py:3: tf32",
                       vs_best=None, signal=False)
    assert out.status == "drop" and "numeric-tf32" in out.reason
    cmp = rules.compare(bench_record([(A, "FASTER", 1.5, 1.6), (B, "SLOWER", 0.8, 0.9)], (1.1, 1.0, 1.2)), None)
    assert "SLOWER on S2/fwd" in rules.decide(gate=GREEN, guard_blocked=False, guard_reason="", vs_best=cmp,
                                              signal=False).reason


# -- records of a loop --------------------------------------------------------------------------

def it(n: int, status: str, direction: str = "d", *, measured: bool = True, gate=GREEN, vs_base=None,
       commit: str | None = None) -> Iteration:
    cmp = rules.compare(bench_record([(A, "FASTER", 1.5, 1.6), (B, "FASTER", 1.5, 1.6)], (1.55, 1.5, 1.6)),
                        f"runs/{n}/record.json") if measured else None
    return Iteration(iter=n, direction="baseline" if n == 0 else direction, status=status,
                     commit=commit or f"{n:040d}", best_before="0" * 40, gate=gate, vs_best=cmp,
                     vs_base=vs_base if vs_base is not None else cmp)


def reassess(n: int, after: int) -> Decision:
    return Decision(n=n, kind="reassess", after_iter=after, created="t", data={})


def test_stall_counts_non_keep_rows_since_the_last_keep_or_reassessment():
    log = [it(0, "baseline"), it(1, "keep"), it(2, "revert"), it(3, "signal"), it(4, "drop"), it(5, "noise")]
    assert rules.stall_count(log, []) == 3  # the signal row counts neither way
    assert rules.stall_count(log, [reassess(1, 4)]) == 1
    assert rules.stall_count(log + [it(6, "keep")], []) == 0
    assert rules.stall_count(log[:3], []) == 1


def test_best_is_the_last_keep_and_pending_signals_are_the_trailing_ones():
    log = [it(0, "baseline"), it(1, "keep"), it(2, "noise"), it(3, "keep"), it(4, "signal"), it(5, "signal")]
    assert rules.best(log).iter == 3
    assert rules.best(log[:1]).status == "baseline"
    assert [s.iter for s in rules.pending_signals(log)] == [5, 4]  # newest first
    assert rules.pending_signals(log[:4]) == []
    assert rules.next_number(log) == 6


@pytest.mark.parametrize("drop, missing", [
    ("baseline", "baseline"), ("attempt", "candidate attempt"), ("full gate", "gate status"),
    ("bench", "bench evidence"), ("bound", "named bound"),
])
def test_each_missing_no_go_item_is_named(drop, missing):
    log = [it(0, "baseline"), it(1, "noise", "bigger tiles")]
    # the bound as bounds.check returns it (its parsing and numbers: tests/unit/test_explain.py)
    bound = good = bounds.Checked(True, text="roofline on S1/fwd: 80.0% of its floor: at most 1.25x left")
    if drop == "baseline":
        log = log[1:]
    elif drop == "attempt":
        log = log[:1]
    elif drop == "full gate":
        log[1].gate = {**GREEN, "signal_only": True}
    elif drop == "bench":
        log[1].vs_best = None
    else:
        bound = bounds.Checked(False, why="no recorded roofline number")  # a limit no record backs
    got = [k for k, _ in rules.no_go_missing(log, bound)]
    assert missing in got
    if drop not in ("attempt",):  # without an attempt, its gate and bench are missing too
        assert got == [missing]
    assert rules.no_go_missing([it(0, "baseline"), it(1, "noise", "x")], good) == []
    assert [k for k, _ in rules.no_go_missing([], None)] == list(rules.NO_GO_ITEMS)


def test_go_needs_a_keep_meeting_the_target_on_the_full_shape_set():
    shapes, modes = ["S1", "S2"], ["fwd"]

    def go(log, dispatch=(), target=1.5):
        return [k for k, _ in rules.go_missing(log, list(dispatch), target_speedup=target, shapes=shapes, modes=modes)]

    log = [it(0, "baseline"), it(1, "keep")]
    assert go(log) == []
    assert go(log, target=1.6) == ["target"]
    assert go(log[:1]) == ["keep"]
    log[1].gate = {**GREEN, "signal_only": True}
    assert go(log) == ["full gate"]
    bucket_only = rules.compare(bench_record([(A, "FASTER", 1.5, 1.6)], (1.55, 1.5, 1.6)), "r")
    assert go([it(0, "baseline"), it(1, "keep", vs_base=bucket_only)]) == ["full shape set"]
    row = DispatchRow(n=1, condition="T<=64", entry="f", why="w", shapes=["S1"], vs_base=bucket_only, latency=[],
                      tree={}, after_iter=1, created="t")
    log = [it(0, "baseline"), it(1, "keep")]
    assert go(log, [row]) == ["full shape set with the dispatch"]
    row.same_as_iter = 1  # the keep's tree is the measured one: its full-shape bench includes the dispatch
    assert go(log, [row]) == []
    row.same_as_iter, row.after_iter = None, 0
    assert go(log, [row]) == []


def test_a_go_on_an_l2_contract_needs_each_l2_state_it_names_measured():
    log = [it(0, "baseline"), it(1, "keep")]  # its cells are the default state, rotate
    assert log[1].vs_base["l2"] == ["rotate"]

    def go(l2):
        return [k for k, _ in rules.go_missing(log, [], target_speedup=1.5, shapes=["S1", "S2"], modes=["fwd"], l2=l2)]

    assert go("rotate") == []
    assert go("cold") == go("both") == ["L2 states"]
    log[1].vs_base = {**log[1].vs_base, "l2": ["cold", "hot"]}
    assert go("both") == go("hot") == go("cold") == []
    log[1].vs_base = {**log[1].vs_base, "l2": ["cold"]}
    [(item, why)] = rules.go_missing(log, [], target_speedup=1.5, shapes=["S1", "S2"], modes=["fwd"], l2="both")
    assert item == "L2 states" and "--l2 both" in why and "no hot cell" in why


def test_state_names_the_phase_and_the_next_command():
    def phase(log, decisions=(), **kw):
        args = {"op": "op", "target_speedup": 1.5, "max_iters": 5, "shapes": ["S1", "S2"], "modes": ["fwd"], **kw}
        return rules.state(log, list(decisions), [], **args)

    assert phase([])["phase"] == "contract"
    st = phase([it(0, "baseline"), it(1, "drop"), it(2, "noise"), it(3, "revert")])
    assert st["phase"] == "stalled" and st["stall"] == {"count": 3, "limit": 3, "stalled": True}
    assert st["next"].startswith("flaloop reassess op")
    assert st["stop_conditions"] == []  # three rows, but one direction ("d") three times
    st = phase([it(0, "baseline"), it(1, "keep")])
    assert st["phase"] == "target met" and st["next"] == "flaloop stop op --go" and st["target"]["met"]
    st = phase([it(0, "baseline"), it(1, "keep")], target_speedup=2.0)
    assert st["phase"] == "iterate" and st["target"]["remaining"] == pytest.approx(2.0 / 1.55 - 1)
    many = [it(0, "baseline")] + [it(i, "noise", f"idea {i}") for i in range(1, 6)]
    st = phase(many, [reassess(1, 5)])
    assert st["phase"] == "cap reached" and "iteration cap reached (5 of 5)" in st["stop_conditions"]
    assert "5 distinct directions tried with bench evidence" in st["stop_conditions"]
    stopped = Decision(n=2, kind="stop", after_iter=5, created="t", data={"verdict": "no-go"})
    assert phase(many, [reassess(1, 5), stopped])["phase"] == "stopped (no-go)"


# -- the dispatch condition language ------------------------------------------------------------

SHAPES = {"small": {"B": 1, "T": 64, "H": 2, "D": 32}, "mid": {"B": 2, "T": 512, "H": 4, "D": 64},
          "big": {"B": 8, "T": 4096, "H": 16, "D": 128}}


@pytest.mark.parametrize("text, names", [
    ("T<=512", ["small", "mid"]), ("T >= 1024 and D == 128", ["big"]), ("64 < T <= 4096", ["mid", "big"]),
    ("H < 4 or (T > 2048 and D >= 64)", ["small", "big"]), ("not D == 64", ["small", "big"]),
    ("B != 2 and not (T > 1000)", ["small"]),
])
def test_conditions_select_their_bucket(text, names):
    assert bucket(Condition.parse(text), SHAPES) == names


@pytest.mark.parametrize("text, says", [
    ("__import__('os').system('x')", "cannot read"), ("T <=", "ends too early"), ("T 512", "needs an operator"),
    ("(T < 5", "ends too early"), ("T < 5)", "unexpected"), ("T + 1 < 5", "cannot read"), ("", "empty"),
    ("X < 5", "not a key of the shapes"), ("T < 5 and", "ends too early"),
])
def test_bad_conditions_are_refused_without_eval(text, says):
    with pytest.raises(UsageError) as exc:
        bucket(Condition.parse(text), SHAPES)
    assert says in exc.value.message


# -- documents ----------------------------------------------------------------------------------

def test_table_rows_round_trip_any_text():
    cells = ["3", "a|b", "back\\slash", "x \\| y", "", "multi\nline"]
    assert records.parse_row(records.render_row(cells)) == ["3", "a|b", "back\\slash", "x \\| y", "", "multi line"]
    assert records.parse_row("not a row") is None


def test_a_note_survives_every_render_and_an_edited_row_is_named(tmp_path):
    ws = Workspace(tmp_path)
    doc = ws.opt_log
    first = "# log\n\n" + "\n".join(records.render_table(("iter", "status"), [["0", "baseline"], ["1", "keep"]]))
    records.write_doc(ws, doc, first, "op")
    doc.write_text(doc.read_text() + "\nI profiled with ncu: smem bound.\n")
    second = first + "\n" + records.render_row(["2", "noise"])
    records.write_doc(ws, doc, second, "op")
    text = doc.read_text()
    assert "| 2 | noise |" in text and text.endswith("I profiled with ncu: smem bound.\n")

    doc.write_text(text.replace("| 1 | keep |", "| 1 | keep (tuned by hand) |"))
    assert [e.where for e in records.check_doc(ws, doc)] == ["row 1"]
    with pytest.raises(records.HandEdited) as exc:
        records.write_doc(ws, doc, second, "op")
    assert "row 1" in exc.value.message and exc.value.exit_code == 1
    assert "keep (tuned by hand)" in doc.read_text()  # nothing overwritten
    saved = records.write_doc(ws, doc, second, "op", restore=True)
    assert saved and "keep (tuned by hand)" in saved.read_text()
    assert records.check_doc(ws, doc) == [] and "I profiled with ncu" in doc.read_text()

    doc.write_text(doc.read_text().replace("| 2 | noise |\n", "| 2 | noise |\na stray remark\n"))
    assert [e.where for e in records.check_doc(ws, doc)] == ["line 8 (added)"]


def test_traps_round_trip_and_append(tmp_path):
    text = traps.render_traps("op", traps.CATALOGUE)
    assert traps.parse_traps(text) == list(traps.CATALOGUE)
    assert len(traps.CATALOGUE) == 10
    ws = Workspace(tmp_path)
    n = traps.add(ws, "op", traps.Trap("stale cache", "f", "w", "h", "added"))
    assert n == 11
    ws.traps_md.write_text(ws.traps_md.read_text() + "\nmy own words\n")
    assert traps.add(ws, "op", traps.Trap("t2", "f2", "w2", "h2", "added")) == 12
    got = traps.parse_traps(ws.traps_md.read_text())
    assert [t.title for t in got[-2:]] == ["stale cache", "t2"] and "my own words" in ws.traps_md.read_text()
