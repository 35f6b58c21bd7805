"""The op's workspace names every path under profile/<op>-opt/ as the layout has it, `clean` keeps
what is new or cited and removes the rest, and the clock's formats read back as the instant written."""

import datetime as dt
import json
import re

import pytest

from flaloop.core import clock
from flaloop.core.errors import UsageError
from flaloop.core.workspace import (
    AREAS,
    Workspace,
    record_file,
    rel_dir,
    shared_sweeps,
    sweep_file,
)
from flaloop.loop import store
from flaloop.loop.store import Decision, DispatchRow, Iteration


def test_every_path_is_where_the_layout_puts_it(tmp_path):
    ws = Workspace.at(tmp_path, "chunk_gla")
    w = tmp_path / "profile" / "chunk_gla-opt"
    assert ws.path == w and ws.op == "chunk_gla" and ws.home == tmp_path and rel_dir("chunk_gla") == "profile/chunk_gla-opt"
    assert Workspace.of(w) == ws and Workspace.of(ws) is ws and Workspace.of(str(w)) == ws
    named = {
        ws.contract: "contract.json", ws.draft: "docs/draft.md",
        ws.runs: "runs", ws.run_dir("20261203T163353Z-bench"): "runs/20261203T163353Z-bench",
        ws.triton_cache: "triton-cache",
        ws.gate: "gate", ws.gate_last: "gate/last.json", ws.gate_calls: "gate/calls.json",
        ws.gate_log("20261203T163353Z"): "gate/gate-20261203T163353Z.log",
        ws.gate_log("20261203T163353Z", 2): "gate/gate-20261203T163353Z-2.log",
        ws.gate_baseline("abc-full-123"): "gate/baseline-abc-full-123.json",
        ws.gate_green("k"): "gate/green-k.json",
        ws.iters: "iters", ws.iteration_file(3): "iters/0003.json",
        ws.decisions: "decisions", ws.decision_file(2, "stop"): "decisions/002-stop.json",
        ws.dispatch: "dispatch", ws.dispatch_file(1): "dispatch/001.json",
        ws.opt_log: "OPT_LOG.md", ws.dispatch_md: "dispatch.md", ws.traps_md: "TRAPS.md",
        ws.rendered_copy(ws.opt_log): ".rendered/OPT_LOG.md",
        ws.trace: "trace", ws.explain: "explain", ws.sanitize: "sanitize", ws.model: "model",
        ws.sweeps: "sweeps", ws.report: "report", ws.lock_file: ".lock",
    }
    for path, rel in named.items():
        assert path == w / rel, rel
    assert shared_sweeps(tmp_path) == tmp_path / "profile" / "sweeps"
    assert record_file(w / "runs" / "x") == w / "runs" / "x" / "record.json"
    assert sweep_file(w / "sweeps" / "s") == w / "sweeps" / "s" / "sweep.json"


def test_paths_in_records_are_relative_to_the_workspace_and_read_back(tmp_path):
    ws = Workspace.at(tmp_path, "op")
    inside, outside = ws.run_dir("r") / "record.json", tmp_path / "elsewhere.json"
    assert ws.rel(inside) == "runs/r/record.json" and ws.path_of("runs/r/record.json") == inside
    assert ws.rel(outside) == str(outside.resolve()) and ws.path_of(ws.rel(outside)) == outside.resolve()
    assert ws.rel(None) is None


def test_the_scans_find_their_documents_oldest_first(tmp_path):
    ws = Workspace.at(tmp_path, "op")
    for d, name in ((ws.runs, "record.json"), (ws.trace, "profile.json"), (ws.explain, "explain.json"),
                    (ws.sanitize, "sanitize.json"), (ws.model, "record.json")):
        for stamp in ("20260102T000000Z", "20260101T000000Z"):
            (d / stamp).mkdir(parents=True)
            (d / stamp / name).write_text("{}")
    for scan, d in ((ws.run_records, ws.runs), (ws.profile_docs, ws.trace), (ws.explain_docs, ws.explain),
                    (ws.sanitize_docs, ws.sanitize), (ws.model_records, ws.model)):
        assert [p.parent for p in scan()] == [d / "20260101T000000Z", d / "20260102T000000Z"]
    ws.gate.mkdir()
    for name in ("gate-2.log", "gate-1.log", "baseline-aaaaaaaaaaaa-full-1.json", "baseline-bbbbbbbbbbbb-full-1.json",
                 "green-x.json", "last.json"):
        (ws.gate / name).write_text("{}")
    assert [p.name for p in ws.gate_logs()] == ["gate-1.log", "gate-2.log"]
    assert [p.name for p in ws.gate_baselines("a" * 40)] == ["baseline-aaaaaaaaaaaa-full-1.json"]
    assert [p.name for p in ws.gate_greens()] == ["green-x.json"]
    other = Workspace.at(tmp_path, "other_op")
    other.path.mkdir(parents=True)
    (tmp_path / "profile" / "sweeps").mkdir()
    assert [w.op for w in Workspace.every(tmp_path)] == ["op", "other_op"]


def test_the_loop_records_are_kept_in_the_workspace_and_moved_aside_whole(tmp_path):
    ws = Workspace.at(tmp_path, "op")
    store.save_iteration(ws, Iteration(1, "tiles", "keep", "c" * 40, "b" * 40))
    store.save_iteration(ws, Iteration(0, "baseline", "baseline", "b" * 40, "b" * 40))
    store.save_decision(ws, Decision(1, "stop", 1, clock.now_iso()))
    store.save_dispatch(ws, DispatchRow(1, "T<=64", "e", "w", ["S"], {}, [], {}, 1, clock.now_iso()))
    assert [i.iter for i in store.iterations(ws)] == [0, 1] and ws.iteration_file(1).is_file()
    assert [d.kind for d in store.decisions(ws)] == ["stop"] and ws.decision_file(1, "stop").is_file()
    assert [r.condition for r in store.dispatch_rows(ws)] == ["T<=64"] and ws.dispatch_file(1).is_file()
    ws.opt_log.write_text("log")
    ws.contract.write_text("{}")
    dest = ws.archive_loop(clock.name_safe(clock.now_iso()))
    assert sorted(p.name for p in dest.iterdir()) == ["OPT_LOG.md", "decisions", "dispatch", "iters"]
    assert store.iterations(ws) == [] and not ws.opt_log.exists() and ws.contract.is_file()
    assert ws.archive_loop("again") is None  # nothing left to move


def _runs(ws: Workspace, names: list[str]) -> None:
    for n in names:
        ws.run_dir(n).mkdir(parents=True)
        record_file(ws.run_dir(n)).write_text("{}")


def test_clean_keeps_the_newest_and_the_cited_and_removes_the_rest(tmp_path):
    ws = Workspace.at(tmp_path, "op")
    _runs(ws, ["20260101T000000Z-bench", "20260102T000000Z-aa", "20260103T000000Z-bench", "20260104T000000Z-bench"])
    ws.gate.mkdir()
    for n in ("gate-20260101T000000Z.log", "gate-20260102T000000Z.log"):
        ws.gate_log(n[5:-4]).write_text("log")
    ws.gate_last.write_text(json.dumps({"log_path": str(ws.gate / "gate-20260101T000000Z.log")}))
    ws.iters.mkdir()
    ws.iteration_file(0).write_text(json.dumps({"baseline": {"record": "runs/20260102T000000Z-aa/record.json"}}))
    (ws.sweeps / "20260201T000000Z").mkdir(parents=True)
    (ws.sweeps / "20260205T000000Z").mkdir(parents=True)
    ws.triton_cache.mkdir()
    plan, doomed = ws.plan_clean(1)
    assert plan.removed == ["runs/20260101T000000Z-bench", "runs/20260103T000000Z-bench", "sweeps/20260201T000000Z"]
    assert sorted(plan.cited) == ["gate/gate-20260101T000000Z.log", "runs/20260102T000000Z-aa"]
    assert "runs/20260104T000000Z-bench" in plan.kept and "gate/gate-20260102T000000Z.log" in plan.kept
    assert doomed == [ws.path / r for r in plan.removed] and plan.removed_sweeps() == ["20260201T000000Z"]
    assert plan.freed_bytes == 2 * len("{}")
    dry = ws.clean(1, dry_run=True)
    assert dry.removed == plan.removed and all(p.exists() for p in doomed)
    done = ws.clean(1)
    assert done.removed == plan.removed and not any(p.exists() for p in doomed)
    assert [p.name for p in ws.run_dirs()] == ["20260102T000000Z-aa", "20260104T000000Z-bench"]
    assert ws.iters.is_dir() and ws.triton_cache.is_dir()  # never touched
    assert ws.clean(0).removed == ["runs/20260104T000000Z-bench", "gate/gate-20260102T000000Z.log",
                                   "sweeps/20260205T000000Z"]


def test_clean_refuses_a_negative_keep_and_a_missing_workspace(tmp_path):
    ws = Workspace.at(tmp_path, "op")
    with pytest.raises(UsageError, match="--keep -1"):
        ws.plan_clean(-1)
    with pytest.raises(UsageError, match="no workspace for 'op'") as e:
        ws.clean(1)
    assert "flaloop init op" in e.value.hint


def test_usage_counts_each_area_and_the_runs(tmp_path):
    ws = Workspace.at(tmp_path, "op")
    _runs(ws, ["a", "b"])
    ws.contract.write_text("x" * 10)
    u = ws.usage()
    assert set(AREAS) <= set(u) and u["runs"] == 4 and u["other"] == 10 and u["total"] == 14 and u["n_runs"] == 2


def test_the_clock_writes_utc_to_the_second_and_reads_back():
    t = dt.datetime(2026, 12, 3, 16, 33, 53, 999, tzinfo=dt.timezone.utc)
    assert clock.iso(t) == "2026-12-03T16:33:53+00:00" and clock.stamp(t) == "20261203T163353Z"
    assert clock.parse_iso(clock.iso(t)) == t.replace(microsecond=0) == clock.parse_stamp(clock.stamp(t))
    assert clock.stamp_of(clock.iso(t)) == clock.stamp(t)
    assert clock.name_safe(clock.iso(t)) == "2026-12-03T163353+0000"
    now = clock.now_iso()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", now)
    assert clock.today() >= now[:10]  # a day may turn between the two readings
    stamp = clock.now_stamp()
    assert re.fullmatch(r"\d{8}T\d{6}Z", stamp) and clock.stamp(clock.parse_stamp(stamp)) == stamp
    assert abs((clock.parse_stamp(stamp) - clock.parse_iso(now)).total_seconds()) < 60
    assert re.fullmatch(r"\d{8}T\d{6}", clock.local_stamp())
