"""`flaloop profile` and `flaloop report` on the toy target: a real gate, a real paired bench and a
real profiler step, then the report's fields, plots and refusals from those stored records."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from support.cli import flaloop
from support.repos import commit_all, edit, fresh_copy, git, make_toy_repo

from flaloop.core import git as git_mod
from flaloop.core.errors import UsageError
from flaloop.guard.findings import Finding
from flaloop.report.build import build as build_report
from flaloop.report.build import commit_states, same_state
from flaloop.report.markdown import render, render_github
from flaloop.report.plots import write_plots
from flaloop.task.target import Target

OP = "toy_attn"
FAST_BENCH = ("--min-pairs", "4", "--max-pairs", "6", "--rounds", "1", "--sample-ms", "1")


@pytest.fixture(scope="module")
def measured(prepared_toy, tmp_path_factory) -> tuple[Path, Path]:
    """The toy with a contract (conftest's `prepared_toy`: B2_T64_H2_D16, fwd and fwdbwd), a full green
    gate, one bench record and one profile (CPU)."""
    tmp = tmp_path_factory.mktemp("report")
    cache = tmp / "cache"
    repo = fresh_copy(prepared_toy, tmp / "toy")
    r = flaloop(repo, "gate", OP, "--json")
    assert r.code == 0, r.stderr
    r = flaloop(repo, "bench", OP, *FAST_BENCH, "--json", env={"XDG_CACHE_HOME": str(cache)})
    assert r.code == 0, r.stderr
    return repo, cache


@pytest.fixture(scope="module")
def profiled(measured) -> tuple[Path, Path]:
    """The same toy with a profile of its working tree (and the device ceilings cached)."""
    repo, cache = measured
    r = flaloop(repo, "profile", OP, "--mode", "fwdbwd", "--ncu", "--json", env={"XDG_CACHE_HOME": str(cache)})
    assert r.code == 0, r.stdout + r.stderr
    return repo, cache


@pytest.fixture
def toy_measured(measured, tmp_path) -> tuple[Path, Path]:
    repo, cache = measured
    return fresh_copy(repo, tmp_path / "toy"), cache


def ws(repo: Path) -> Path:
    return repo / "profile" / f"{OP}-opt"


def the_record(repo: Path) -> Path:
    return next((ws(repo) / "runs").glob("*-bench/record.json"))


def as_win(repo: Path) -> None:
    """Make the stored bench read as a clear win (the report only reads records)."""
    p = the_record(repo)
    rec = json.loads(p.read_text())
    rec["summary"]["geomean"].update(speedup=1.5, ci_low=1.3, ci_high=1.7, n_regressions=0)
    for cell in rec["cells"]:
        cell["verdict"] = "FASTER"
    p.write_text(json.dumps(rec))


def build(repo: Path) -> dict:
    return build_report(Target.discover(repo), OP)


# -- the profiler ---------------------------------------------------------------------------------

def test_profile_records_both_sides_on_cpu_and_says_ncu_needs_a_gpu(profiled):
    repo, cache = profiled
    doc = json.loads(next((ws(repo) / "trace").glob("*/profile.json")).read_text())
    assert doc["kind"] == "profile" and doc["cell"]["id"] == "B2_T64_H2_D16/fwdbwd"
    assert doc["kernels_are"].startswith("CPU ops")
    for side in ("base", "cand"):
        d = doc[side]
        assert d["kernels"] and d["n_launches"] > 0 and d["step_wall_ms"] > 0
        assert any("bmm" in k["name"] or "einsum" in k["name"] for k in d["kernels"])  # the toy's matmuls
        trace = json.loads(Path(d["trace"]).read_text())
        assert any(ev.get("name") == "flaloop_step" for ev in trace["traceEvents"])
    assert "/base" in doc["base"]["hello"]["op_module_file"]          # the base ran from its worktree
    assert doc["cand"]["hello"]["op_module_file"].startswith(str(repo.resolve()))
    assert doc["ncu"]["available"] is False and "no GPU" in doc["ncu"]["reason"]
    assert doc["candidate"]["head"] == git_mod.head_commit(repo)
    # the ceilings were measured once, into the cache the report reads
    assert (cache / "flaloop" / "ceilings-cpu.json").is_file()
    assert doc["roofline"]["family"] == "softmax" and doc["roofline"]["floor_ms"] > 0


# -- the report -----------------------------------------------------------------------------------

def test_report_from_a_real_bench_has_every_field_and_plots(profiled, tmp_path):
    repo, cache = profiled
    out = tmp_path / "rep"
    r = flaloop(repo, "report", OP, "--json", "--out", str(out), env={"XDG_CACHE_HOME": str(cache)})
    assert r.code == 0, r.stdout + r.stderr
    doc = r.json
    assert doc["claim_ok"] is True and doc["refused"] == []
    assert doc["claim"]["source"] == "tree" and doc["claim"]["commit"] == git_mod.head_commit(repo)
    gate = doc["test_plan"]["gate"]
    assert gate["green"] and not gate["signal_only"] and gate["counts"]["passed"] == 2
    assert doc["test_plan"]["test_file"] == "tests/ops/test_toy.py"
    assert len(doc["cells"]) == 2
    for cell in doc["cells"]:
        for key in ("device", "eager"):
            for side in ("base", "cand"):
                assert set(cell[key][side]) >= {"median", "mean", "std", "min", "p10", "p90", "n"}
        assert cell["ci_low"] <= cell["speedup"] <= cell["ci_high"]
        assert cell["verdict"] in ("FASTER", "SLOWER", "SAME", "UNSURE")
        assert cell["launch_bound"] in (True, False)
        roof = cell["roofline"]
        assert roof["floor_ms"] > 0 and roof["pct_of_floor_cand"] > 0 and roof["bound"] in ("memory", "compute")
    assert doc["summary"]["geomean"]["ci_low"] <= doc["summary"]["geomean"]["speedup"]
    assert doc["coverage"] == {"dense": ["B2_T64_H2_D16/fwd", "B2_T64_H2_D16/fwdbwd"], "varlen": [],
                               "modes": ["fwd", "fwdbwd"], "l2": ["rotate"], "shapes": ["B2_T64_H2_D16"]}
    assert doc["commands"]["bench"].startswith(f"flaloop bench {OP}")
    assert doc["commits"]["base_commit"] == git_mod.head_commit(repo)
    assert doc["environment"]["device"] == "cpu" and doc["environment"]["idle"]["available"] is False
    assert doc["environment"]["during"]["available"] is False
    assert doc["roofline"]["family"] == "softmax" and doc["roofline"]["ceilings"]["device"] == "cpu"
    assert doc["profile"]["cell"]["id"] == "B2_T64_H2_D16/fwdbwd"
    # no rule fired; a loaded machine may add the warning that contention left a timing check unsure
    assert {k: doc["guard"][k] for k in ("ran", "blocked", "allowed")} == {"ran": True, "blocked": False, "allowed": []}
    assert {(f["rule"], f["severity"]) for f in doc["guard"]["findings"]} <= {("contended-unsure", "warn")}
    assert any("no varlen" in r for r in doc["risks"]) and any("A/A" in r for r in doc["risks"])
    # the worker's hello reports TileLang and CuTe DSL (absent here)
    rec = json.loads(Path(doc["records"]["claim"]).read_text())
    assert {"tilelang", "cutlass"} <= set(rec["workers"]["base"])
    md = (out / "REPORT.md").read_text()
    for heading in ("## Summary", "## Test plan", "## Benchmark", "## Reproduce", "## Environment", "## Profile",
                    "## Guard", "## Conclusion and risk", "### Device time per call (ms)", "### Eager latency"):
        assert heading in md
    assert "2 passed of the full file `tests/ops/test_toy.py`" in md
    assert json.loads((out / "report.json").read_text())["op"] == OP
    # the Reproduce block: commands a shell reads back as they were meant, `verify` (never `iter`,
    # which commits) with the record's own options, and paths the repository names
    block = md.split("## Reproduce", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [a[:2] for a in lines] == [["flaloop", "gate"], ["flaloop", "verify"], ["flaloop", "bench"],
                                      ["flaloop", "profile"], ["flaloop", "report"]]
    verify = lines[1]
    assert verify[verify.index("--base") + 1] == git_mod.head_commit(repo) and "iter" not in block
    recorded = json.loads(Path(doc["records"]["claim"]).read_text())["config"]
    assert verify[verify.index("--min-pairs") + 1] == str(recorded["min_pairs"])
    assert f"`{Path(doc['records']['claim']).relative_to(repo)}`" in md and str(repo) not in md.split("## Reproduce")[1]

    import matplotlib.image as mpimg

    assert set(doc["files"]["plots"]) == {"speedup", "times"}  # no loop, no trajectory
    for png in doc["files"]["plots"].values():
        assert Path(png).stat().st_size > 1000
        h, w, _ = mpimg.imread(png).shape
        assert h > 100 and w > 100


def test_a_win_on_a_k_gate_is_refused_with_exit_1(toy_measured):
    repo, cache = toy_measured
    as_win(repo)
    last = ws(repo) / "gate" / "last.json"
    gate = json.loads(last.read_text())
    gate.update(k_expr="17", signal_only=True)
    last.write_text(json.dumps(gate))
    r = flaloop(repo, "report", OP, "--json", "--no-plots", env={"XDG_CACHE_HOME": str(cache)})
    assert r.code == 1, r.stdout + r.stderr
    assert [x["reason"] for x in r.json["refused"]] == ["gate_signal_only"]
    assert r.json["claim_ok"] is False and r.json["conclusion"]["kind"] == "improvement"
    assert "REFUSED" in (ws(repo) / "report" / "REPORT.md").read_text()
    assert "gate_signal_only" in r.stderr


def test_a_win_on_a_red_or_missing_gate_is_refused(toy_measured):
    repo, _ = toy_measured
    as_win(repo)
    last = ws(repo) / "gate" / "last.json"
    gate = json.loads(last.read_text())
    last.write_text(json.dumps({**gate, "green": False}))
    assert [x["reason"] for x in build(repo)["refused"]] == ["gate_red"]
    last.unlink()
    p = the_record(repo)
    p.write_text(json.dumps({**json.loads(p.read_text()), "last_gate": None}))
    assert [x["reason"] for x in build(repo)["refused"]] == ["gate_missing"]


def test_a_win_with_a_blocking_guard_finding_is_refused_and_allowances_are_listed(toy_measured):
    repo, _ = toy_measured
    as_win(repo)
    p = the_record(repo)
    rec = json.loads(p.read_text())
    f = Finding("numeric-tf32", "block", "allow_tf32 turned on", file="toyop/ops/toy/fast.py", line=3)
    rec["guard"] = {"blocked": True, "findings": [f.to_dict()]}
    p.write_text(json.dumps(rec))
    cpath = ws(repo) / "contract.json"
    c = json.loads(cpath.read_text())
    c["allowed"] = [{"rule": "vendor-matmul", "why": "glue only", "added": "2026-11-30"}]
    cpath.write_text(json.dumps(c))
    doc = build(repo)
    assert [x["reason"] for x in doc["refused"]] == ["guard_blocked"]
    assert "numeric-tf32" in doc["refused"][0]["message"]
    assert doc["guard"]["allowed"][0]["rule"] == "vendor-matmul"
    # an allowed finding does not block
    rec["guard"] = {"blocked": False, "findings": [{**f.to_dict(), "allowed": "reviewed", "blocking": False}]}
    p.write_text(json.dumps(rec))
    assert build(repo)["claim_ok"] is True


def test_a_win_with_blocked_cells_is_refused(toy_measured):
    repo, _ = toy_measured
    as_win(repo)
    p = the_record(repo)
    rec = json.loads(p.read_text())
    rec["summary"]["n_blocked"] = 1
    rec["cells"][0]["status"] = "blocked"
    p.write_text(json.dumps(rec))
    assert "correctness_blocked" in [x["reason"] for x in build(repo)["refused"]]


def test_records_of_another_tree_state_are_refused(toy_measured):
    repo, _ = toy_measured
    as_win(repo)
    edit(repo / "toyop" / "ops" / "toy" / "fast.py", "a = a.tril()", "a = a.tril() * 1.0")
    doc = build(repo)
    assert [x["reason"] for x in doc["refused"]] == ["commit_mismatch"]
    assert "+dirty:" in doc["refused"][0]["message"]


def test_a_neutral_result_is_reported_with_its_gaps_as_risks_not_refused(toy_measured):
    repo, _ = toy_measured
    (ws(repo) / "gate" / "last.json").unlink()
    p = the_record(repo)
    rec = json.loads(p.read_text())
    rec["summary"]["geomean"].update(speedup=1.0, ci_low=0.9, ci_high=1.1)
    rec["last_gate"] = None
    p.write_text(json.dumps(rec))
    doc = build(repo)
    assert doc["claim_ok"] is True and doc["conclusion"]["kind"] == "neutral"
    assert any(r.startswith("gate_missing") for r in doc["risks"])


# -- with a loop ----------------------------------------------------------------------------------

def _iteration(n: int, status: str, commit: str, speedup: float | None, record: str | None = None) -> dict:
    geo = None if speedup is None else {"speedup": speedup, "ci_low": speedup - 0.05, "ci_high": speedup + 0.05}
    return {"schema": 1, "iter": n, "created": "2026-11-30T00:00:00+00:00", "direction": f"direction {n}",
            "status": status, "commit": commit, "best_before": commit, "revert_commit": None,
            "gate": {"green": True, "signal_only": False, "counts": {"passed": 2, "selected": 2}, "k_expr": None,
                     "log_path": None},
            "guard": {"blocked": False, "findings": []},
            "vs_best": None, "vs_base": None if geo is None else {"record": record, "geomean": geo, "verdict": "FASTER",
                                                                 "cells": []},
            "worst_cell": None, "note": "", "wall_s": 1.0, "command": "flaloop iter"}


def _kept_loop(repo: Path) -> tuple[str, str, Path]:
    """A loop whose iteration 2 benched a dirty tree and then committed it: (base, kept, record)."""
    base = git_mod.head_commit(repo)
    # the loop benched a dirty tree (a new file among the changes), then committed it as iteration 2
    edit(repo / "toyop" / "ops" / "toy" / "fast.py", "a = a.tril()", "a = a.tril()  # iteration 2")
    (repo / "toyop" / "ops" / "toy" / "notes.py").write_text("X = 1\n")
    state = git_mod.tree_state(repo)
    rec_path = the_record(repo)
    rec = json.loads(rec_path.read_text())
    rec["candidate"] = {**rec["candidate"], **state}
    rec["last_gate"] = None  # it was of the base's tree state, not of this fabricated one
    rec["summary"]["geomean"].update(speedup=1.25, ci_low=1.2, ci_high=1.3)
    new_dir = rec_path.parent.parent / "29991231T000000Z-bench"
    new_dir.mkdir()
    (new_dir / "record.json").write_text(json.dumps(rec))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "iteration 2")
    kept = git_mod.head_commit(repo)
    iters = ws(repo) / "iters"
    iters.mkdir()
    for it in (_iteration(0, "baseline", base, None), _iteration(1, "revert", base, 0.97),
               _iteration(2, "keep", kept, 1.25, str(new_dir / "record.json"))):
        (iters / f"{it['iter']:04d}.json").write_text(json.dumps(it))
    return base, kept, new_dir / "record.json"


def test_with_a_loop_the_claim_is_the_best_kept_iteration_benched_dirty_then_committed(toy_measured, tmp_path):
    repo, cache = toy_measured
    base, kept, new_record = _kept_loop(repo)
    new_dir = new_record.parent
    # the gate of iteration 2 was taken of the same tree state; last.json is older (of the base)
    doc = build(repo)
    assert doc["claim_ok"] is True, doc["refused"]
    assert doc["claim"]["source"] == "loop" and doc["claim"]["iteration"] == 2 and doc["claim"]["commit"] == kept
    assert doc["records"]["claim"] == str(new_dir / "record.json")
    assert doc["test_plan"]["gate"]["source"] == "iteration 2"
    assert [t["status"] for t in doc["trajectory"]] == ["baseline", "revert", "keep"]
    assert doc["conclusion"]["kind"] == "improvement"
    plots = write_plots(doc, tmp_path / "rep")
    assert set(plots) == {"speedup", "times", "trajectory"} and Path(plots["trajectory"]).stat().st_size > 1000
    md = render(doc, plots)
    assert "## Trajectory (OPT_LOG)" in md and "| 2 | keep | direction 2 | 1.2500x" in md


def test_a_loop_without_a_kept_iteration_is_a_no_go(toy_measured):
    repo, _ = toy_measured
    base = git_mod.head_commit(repo)
    iters = ws(repo) / "iters"
    iters.mkdir()
    for it in (_iteration(0, "baseline", base, None), _iteration(1, "revert", base, 0.97),
               _iteration(2, "noise", base, 1.001)):
        (iters / f"{it['iter']:04d}.json").write_text(json.dumps(it))
    doc = build(repo)
    assert doc["conclusion"]["kind"] == "no-go" and doc["claim"]["no_go"] is True
    assert doc["claim_ok"] is True and len(doc["trajectory"]) == 3
    # a no-go stands on the baseline's A/A: that is no gap in its evidence (H200, 2026-11-30)
    p = the_record(repo)
    p.write_text(json.dumps({**json.loads(p.read_text()), "aa": True}))
    doc = build(repo)
    assert doc["conclusion"]["kind"] == "no-go" and "A/A self-check" not in json.dumps(doc["risks"])


def _copy_record(repo: Path, rec: dict, stamp: str, **changes) -> str:
    """`rec` stored as another run, `changes` merged in: its path relative to the workspace, as the
    loop's iteration records name theirs."""
    rec = {**rec, **changes}
    d = ws(repo) / "runs" / f"{stamp}-bench"
    d.mkdir()
    (d / "record.json").write_text(json.dumps(rec))
    return f"runs/{d.name}/record.json"


def test_a_loop_claim_stands_on_its_own_records_not_on_a_later_bench_of_another_environment(toy_measured):
    """A no-go loop's report shows its baseline's A/A, a kept iteration's its own vs-base record
    (named relative to the workspace), though a newer record of the same tree exists: `bench
    --cand-env FLA_TILELANG=1` on the reverted tree (docs/lab/2026-12-02-h200.md, R20) is the backend
    question, not the loop's, and its blocked cells must not read as the loop's."""
    repo, _ = toy_measured
    base = git_mod.head_commit(repo)
    rec = json.loads(the_record(repo).read_text())
    aa = _copy_record(repo, rec, "20000101T000000Z", aa=True)
    switched = _copy_record(repo, rec, "29991231T000000Z", config={**rec["config"], "cand_env": {"FLA_TILELANG": "1"}})
    iters = ws(repo) / "iters"
    iters.mkdir()
    baseline = {**_iteration(0, "baseline", base, None), "baseline": {"record": aa}}
    for it in (baseline, _iteration(1, "revert", base, 0.97)):
        (iters / f"{it['iter']:04d}.json").write_text(json.dumps(it))
    doc = build(repo)
    assert doc["claim"]["no_go"] is True
    assert doc["records"]["claim"] == str(ws(repo) / aa), doc["records"]
    # without its own record, the no-go takes the newest of the baseline's code, still not the switched one
    (iters / "0000.json").write_text(json.dumps(_iteration(0, "baseline", base, None)))
    assert build(repo)["records"]["claim"] != str(ws(repo) / switched)
    # a kept iteration: its own record, though a later plain bench measured the same tree
    own = _copy_record(repo, rec, "20100101T000000Z")
    _copy_record(repo, rec, "20200101T000000Z")
    (iters / "0001.json").write_text(json.dumps(_iteration(1, "keep", base, 1.2, own)))
    assert build(repo)["records"]["claim"] == str(ws(repo) / own)


def test_without_a_loop_the_report_stands_on_the_newest_complete_record_and_names_it(toy_measured):
    """A newer interrupted bench (no cell measured) or a partial one never replaces a complete record."""
    repo, _ = toy_measured
    complete = the_record(repo)
    rec = json.loads(complete.read_text())
    unmeasured = [{**c, "status": "failed", "estimate": None, "verdict": None} for c in rec["cells"]]
    interrupted = _copy_record(repo, rec, "29991231T000000Z", interrupted=True, cells=unmeasured,
                               summary={**rec["summary"], "geomean": None, "n_measured": 0})
    doc = build(repo)
    assert doc["records"]["claim"] == str(complete) and doc["records"]["claim_complete"] == "complete"
    assert doc["records"]["skipped"] == [str(ws(repo) / interrupted)]
    assert doc["conclusion"]["text"] != "no-go: no cell could be measured"
    assert "not used: `" in render(doc, {})
    assert "\n- Gate: **GREEN**" in render_github(doc)  # the pull-request comment says which gate
    # a partial record (one cell measured of two) is passed over too; alone, an interrupted one stands
    partial = _copy_record(repo, rec, "29991231T000001Z", cells=[rec["cells"][0], unmeasured[1]])
    assert build(repo)["records"]["claim"] == str(complete)
    complete.unlink()
    doc = build(repo)
    assert doc["records"]["claim"] == str(ws(repo) / partial) and doc["records"]["claim_complete"] == "partial"
    r = flaloop(repo, "report", OP, "--no-plots")
    assert f"stands on: {ws(repo) / partial} (partial)\n" in r.stdout  # the interrupted one is older: not named


def test_no_record_or_no_contract_is_a_usage_error(toy_measured):
    repo, _ = toy_measured
    shutil.rmtree(ws(repo) / "runs")
    with pytest.raises(UsageError, match="no bench record"):
        build(repo)
    shutil.rmtree(ws(repo))
    with pytest.raises(UsageError) as exc:
        build(repo)
    assert "flaloop init" in exc.value.hint


def test_commit_states_recognise_a_committed_dirty_tree(tmp_path):
    repo = commit_all_toy(tmp_path)
    edit(repo / "toyop" / "ops" / "toy" / "fast.py", "a = a.tril()", "a = a.tril()  # x")
    dirty_tracked = git_mod.tree_state(repo)
    (repo / "new_file.py").write_text("Y = 2\n")
    dirty_untracked = git_mod.tree_state(repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "c")
    states = commit_states(repo, git_mod.head_commit(repo))
    assert any(same_state(dirty_untracked, s) for s in states)
    assert not any(same_state(dirty_tracked, s) for s in states)  # not what was committed
    assert states[0] == {"head": git_mod.head_commit(repo), "dirty": False, "diff_hash": None}


def commit_all_toy(tmp_path: Path) -> Path:
    repo = make_toy_repo(tmp_path / "t")
    return commit_all(repo) if not (repo / ".git").exists() else repo


def test_a_profile_of_the_same_code_at_another_commit_explains_the_record(tmp_path):
    """A loop's reverts leave HEAD on a new commit whose tree is the base's: a profile taken there
    is a reading of the baseline's code (H200, 2026-11-30: the no-go report said it had none)."""
    from support.repos import git

    from flaloop.report.build import _profile_for

    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "k.py").write_text("a = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "k.py").write_text("a = 2\n")
    git(repo, "commit", "-qam", "try")
    tried = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "revert", "--no-edit", "HEAD")
    reverted = git(repo, "rev-parse", "HEAD").strip()
    record = {"candidate": {"head": base, "dirty": False, "diff_hash": None}}
    other = {"candidate": {"head": tried, "dirty": False, "diff_hash": None}, "created": "1"}
    same_code = {"candidate": {"head": reverted, "dirty": False, "diff_hash": None}, "created": "2"}
    assert _profile_for(repo, [other], record["candidate"]) is None
    assert _profile_for(repo, [same_code, other], record["candidate"]) is same_code
    dirty = {"candidate": {"head": reverted, "dirty": True, "diff_hash": "abc"}}
    assert _profile_for(repo, [dirty], record["candidate"]) is None


def _sanitized(repo: Path, base: str, kept: str, stamp: str, tools: dict, findings: list | None = None) -> Path:
    """A stored sanitize.json of `kept` against `base` (the report only reads it)."""
    d = ws(repo) / "sanitize" / stamp
    d.mkdir(parents=True)
    doc = {"kind": "sanitize", "schema": 1, "op": OP, "created": stamp, "base_commit": base,
           "candidate": {"commit": kept}, "cells": ["B2_T64_H2_D16/fwd", "B2_T64_H2_D16/fwdbwd"],
           "sanitizer": {"path": "/x/compute-sanitizer", "version": "Version 2099.1.0 (build 1) (public-release)"},
           "tools": tools, "findings": findings or [], "blocked": any(f["blocking"] for f in findings or []),
           "failed": [], "wall_s": 12.5, "path": str(d / "sanitize.json")}
    (d / "sanitize.json").write_text(json.dumps(doc))
    return d / "sanitize.json"


def _tool(errors_base: int, errors_cand: int, new: bool = False) -> dict:
    side = {"status": "ok", "reason": "", "wall_s": 3.25, "errors": 0}
    return {"available": True, "reason": "ran on both sides", "new": [{"kind": "x"}] if new else [],
            "pre_existing": [], "unchecked": [],
            "sides": {"base": {**side, "errors": errors_base}, "cand": {**side, "errors": errors_cand}}}


def test_the_report_shows_the_kept_commits_sanitizer_run_and_a_candidate_only_error_refuses_the_claim(toy_measured):
    repo, _ = toy_measured
    base, kept, _ = _kept_loop(repo)
    doc = build(repo)
    assert doc["sanitizer"] is None and doc["claim_ok"] is True
    assert any("no compute-sanitizer run of the kept commit" in r for r in doc["risks"])
    assert f"flaloop sanitize {OP} --commit {kept[:12]}" in render(doc)
    # two tools only: the section shows them, the risks name the two that did not run
    clean = _sanitized(repo, base, kept, "20990101T000000Z", {"memcheck": _tool(0, 0), "initcheck": _tool(1, 1)})
    doc = build(repo)
    assert doc["sanitizer"]["path"] == str(clean) and doc["records"]["sanitizer"] == str(clean) and doc["claim_ok"]
    assert any("did not run racecheck, synccheck" in r for r in doc["risks"])
    md = render(doc)
    section = md[md.index("## Sanitizer"):md.index("## Profile")]
    assert "compute-sanitizer 2099.1.0" in section and "| memcheck | 0 | 0 | clean | 3.2 | 3.2 |" in section
    assert "| initcheck | 1 | 1 | pre-existing only |" not in section  # pre_existing is empty: still clean
    # a newer run where the candidate alone has a memcheck error: the claim is refused, naming it
    bad = {"rule": "sanitizer-memcheck", "severity": "block", "blocking": True, "cell": "B2_T64_H2_D16/fwd",
           "message": "Invalid __global__ read in toy_kernel"}
    _sanitized(repo, base, kept, "20990102T000000Z", {t: _tool(0, 0) for t in ("racecheck", "initcheck", "synccheck")}
               | {"memcheck": _tool(0, 4, new=True)}, [bad])
    doc = build(repo)
    assert doc["claim_ok"] is False
    assert [r["reason"] for r in doc["refused"]] == ["sanitizer"] and "toy_kernel" in doc["refused"][0]["message"]
    md = render(doc)
    assert "| memcheck | 0 | 4 | **new errors** |" in md and "Invalid __global__ read in toy_kernel" in md
    # a machine without compute-sanitizer: one line with the reason, not a table of it
    off = {"available": False, "reason": "compute-sanitizer is not on PATH", "sides": {}, "new": [], "pre_existing": []}
    _sanitized(repo, base, kept, "20990103T000000Z", {t: off for t in ("memcheck", "racecheck", "initcheck", "synccheck")})
    md = render(build(repo))
    section = md[md.index("## Sanitizer"):md.index("## Profile")]
    assert "compute-sanitizer checked nothing" in section and section.count("not on PATH") == 1 and "| tool |" not in section
