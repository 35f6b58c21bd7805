"""The loop as a user runs it, on the pure-torch toy target: real git, real gates, real benches.

Speed differences are made deterministic with a `time.sleep` in one side (5 ms per call against
a ~0.1 ms op), so FASTER and SLOWER do not depend on how busy the machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.cli import flaloop
from support.repos import GIT_ENV, edit, fresh_copy, git, make_toy_repo, worktrees

OP = "toy_attn"
FAST = Path("toyop/ops/toy/fast.py")
# the unseen-shapes check is off here (it has its own tests, tests/e2e/test_unseen.py): the suite's time
QUICK = ["--device", "cpu", "--min-pairs", "4", "--max-pairs", "8", "--rounds", "1", "--cell-seconds", "5",
         "--sample-ms", "2", "--unseen-shapes", "0"]
# one torch thread per worker: two workers spinning on a shared 2-core machine time each other's slices
ENV = {**GIT_ENV, "OMP_NUM_THREADS": "1"}
SLEEP = "    import time; time.sleep(0.005)\n    scale = q.shape"
WRONG_AT_BENCH_SHAPE = ("return o.to(q.dtype), None",
                        "return (o * (1.5 if q.shape[1] > 32 else 1.0)).to(q.dtype), None")  # the gate uses T=5, 17
WRONG = ("return o.to(q.dtype), None", "return (o * 1.5).to(q.dtype), None")


def fl(repo: Path, *args: str):
    return flaloop(repo, *args, env=ENV)


def ws(repo: Path) -> Path:
    return repo / "profile" / f"{OP}-opt"


def record(repo: Path, n: int) -> dict:
    return json.loads((ws(repo) / "iters" / f"{n:04d}.json").read_text())


def log_lines(repo: Path) -> list[str]:
    return git(repo, "log", "--format=%H %s").splitlines()


def iterate(repo: Path, direction: str, *extra: str):
    r = fl(repo, "iter", OP, direction, "--json", *QUICK, *extra)
    assert r.stdout.strip(), r.stderr
    return r, r.json


@pytest.fixture(scope="module")
def slow_toy(tmp_path_factory) -> Path:
    """The toy with a slow base (a sleep per call), a contract and a recorded baseline: copy it."""
    repo = make_toy_repo(tmp_path_factory.mktemp("loop") / "toy")
    edit(repo / FAST, "    scale = q.shape", SLEEP)
    git(repo, "commit", "-qam", "a slow base")
    r = fl(repo, "init", OP, "--shapes", "B2_T64_H2_D16,B1_T128_H2_D32", "--modes", "fwd", "--target", "1.5x")
    assert r.code == 0, r.stderr
    (repo / "wip.txt").write_text("not the base")  # the base's gate then runs in a worktree of the base
    r = fl(repo, "baseline", OP, "--json", *QUICK)
    assert r.code == 0, r.stderr
    assert "temporary worktree" in r.stderr and worktrees(repo) == [str(repo)]
    (repo / "wip.txt").unlink()
    return repo


def test_a_bucket_earned_by_a_backend_switch_says_so_in_its_dispatch_row(slow_toy, tmp_path):
    """Phase 3 with `--cand-env` (FLA_TILELANG=1 for a bucket, say): the same code with a path
    switched on for the candidate only; the row records the variable, and no kept tree stands for it."""
    repo = fresh_copy(slow_toy, tmp_path / "toy")
    edit(repo / FAST, SLEEP, "    import os\n    if os.environ.get('TOY_PATH') != 'fast':\n"
                             "        import time; time.sleep(0.005)\n    scale = q.shape")
    r = fl(repo, "dispatch", "add", OP, "--when", "T<=64", "--entry", "toy_attn", "--why", "the fast path for short",
           "--cand-env", "TOY_PATH=fast", "--json", *QUICK)
    assert r.code == 0, r.stderr
    row = r.json["row"]
    assert row["cand_env"] == {"TOY_PATH": "fast"} and row["vs_base"]["verdict"] == "FASTER"
    assert row["same_as_iter"] is None
    assert "with TOY_PATH=fast" in (ws(repo) / "dispatch.md").read_text()


def test_keep_then_revert_with_rows_commits_notes_and_a_measured_dispatch(slow_toy, tmp_path):
    repo = fresh_copy(slow_toy, tmp_path / "toy")
    base = git(repo, "rev-parse", "HEAD").strip()
    b = record(repo, 0)
    assert b["status"] == "baseline" and b["commit"] == base and b["gate"]["green"]
    assert [c["id"] for c in b["baseline"]["cells"]] == ["B2_T64_H2_D16/fwd", "B1_T128_H2_D32/fwd"]
    assert all(c["device_ms"] > 0 and c["eager_ms"] > 0 for c in b["baseline"]["cells"])
    assert b["baseline"]["env"]["torch"] and (ws(repo) / b["baseline"]["record"]).is_file()
    assert (ws(repo) / "TRAPS.md").read_text().count("\n## T") == 10
    opt_log = ws(repo) / "OPT_LOG.md"
    assert f"| 0 | {base[:12]} | baseline |" in opt_log.read_text()
    r = fl(repo, "baseline", OP)
    assert r.code == 2 and "--force" in r.stderr
    opt_log.write_text(opt_log.read_text() + "\nProfiled the base: all of it is the sleep.\n")

    # 1: an honest speedup (the sleep goes) is kept: one row, one commit with its trailer, tree clean
    edit(repo / FAST, SLEEP, "    scale = q.shape")
    r, doc = iterate(repo, "drop the sleep")
    assert r.code == 0, r.stderr
    one = doc["iteration"]
    assert one["status"] == "keep", one["note"]
    assert one["vs_best"]["verdict"] == "FASTER" and one["vs_base"] == one["vs_best"]  # best = base: one bench
    assert one["revert_commit"] is None and one["files"] == [str(FAST)]
    assert git(repo, "rev-parse", "HEAD").strip() == one["commit"]
    body = git(repo, "log", "-1", "--format=%B")
    assert "flaloop iter 1 [keep]: drop the sleep" in body and "Flaloop-Iteration: 1" in body
    assert "vs best" in body and "vs base" in body and "Gate: green" in body
    assert git(repo, "status", "--porcelain") == ""

    # 2: a slower change is measured against the best (iteration 1) and the base, then reverted
    edit(repo / FAST, "    scale = q.shape", SLEEP)
    r, doc = iterate(repo, "sleep again")
    assert r.code == 0, r.stderr
    two = doc["iteration"]
    assert two["status"] == "revert", two["note"]
    assert two["best_before"] == one["commit"] and two["vs_best"]["base_commit"] == one["commit"]
    assert two["vs_base"]["base_commit"] == base and two["vs_base"]["record"] != two["vs_best"]["record"]
    assert git(repo, "diff", one["commit"], "HEAD") == ""  # the tree is back at the best
    subjects = [line.split(" ", 1)[1] for line in log_lines(repo)[:3]]
    assert subjects == ['flaloop iter 2 [revert]: revert "sleep again"', "flaloop iter 2 [revert]: sleep again",
                        "flaloop iter 1 [keep]: drop the sleep"]
    assert "Flaloop-Iteration: 2" in git(repo, "log", "-1", "--format=%B")

    text = opt_log.read_text()
    assert text.endswith("Profiled the base: all of it is the sleep.\n")  # the note survived two appends
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert "| keep |" in rows[0] and "| revert |" in rows[1] and two["revert_commit"][:12] in rows[1]
    assert record(repo, 2)["status"] == "revert"

    # phase 3: the bucket T<=64 measured against the base earns a row; a bucket without shapes does not
    r = fl(repo, "dispatch", "add", OP, "--when", "T<=64", "--entry", "toy_attn", "--why", "short sequences",
           "--json", *QUICK)
    assert r.code == 0, r.stderr
    row = r.json["row"]
    assert row["shapes"] == ["B2_T64_H2_D16"] and row["vs_base"]["verdict"] == "FASTER"
    assert row["latency"][0]["base_ms"] > row["latency"][0]["cand_ms"] > 0
    assert row["same_as_iter"] == 1  # measured on the kept tree
    assert "| 1 | T<=64 | toy_attn | B2_T64_H2_D16 |" in (ws(repo) / "dispatch.md").read_text()
    r = fl(repo, "dispatch", OP, "add", "--when", "T>100000", "--entry", "toy_attn", "--why", "huge", *QUICK)
    assert r.code == 2 and "needs a measurement" in r.stderr
    assert f"the order is `flaloop dispatch add {OP}`" in r.stderr  # the older order still works, and says so
    assert len(list((ws(repo) / "dispatch").glob("*.json"))) == 1

    r = fl(repo, "header", OP, "--iter", "1")
    assert r.code == 0 and "# Delta:" in r.stdout and "#1 drop the sleep" in r.stdout
    assert "#2 sleep again: revert" in r.stdout
    r = fl(repo, "stop", OP, "--go", "--json")  # no explanation recorded: the go profiles both sides itself
    assert r.code == 0, r.stdout + r.stderr
    assert r.json["decision"]["data"]["iter"] == 1 and "**go**" in opt_log.read_text()
    expl = r.json["explanation"]
    assert expl["cand_commit"] == one["commit"] and expl["base_commit"] == base and not expl["blocked"]
    assert r.json["decision"]["data"]["explanation"] == str(Path(expl["_path"]).relative_to(ws(repo)))
    assert 0.5 <= r.json["decision"]["data"]["explained_share"] <= 1.5  # the sleep: host time outside any op
    host = {k["name"]: k for k in expl["cells"][0]["kernels"]}["(host time outside any op)"]
    # the 5 ms sleep is what went: the band, not the candidate's own host time, which load stretches
    assert host["base_ms"] > 4 and host["base_ms"] - host["cand_ms"] > 3
    # each side's progress names the cell it is at; each cell says where its profile's time went
    assert "    base: B2_T64_H2_D16/fwd" in r.stderr and "    cand: B2_T64_H2_D16/fwd" in r.stderr
    side = json.loads((Path(expl["_path"]).parent / "round-1" / "cells-cand.json").read_text())  # a run per round
    wall = side["cells"]["B2_T64_H2_D16/fwd"]["wall_s"]
    assert set(wall) == {"setup", "warm", "profiled", "trace", "tuning_in_setup"} and wall["profiled"] > 0
    notes = r.json["decision"]["data"]["sanitizer_notes"]  # the go ran the sanitizer step, which says why not
    assert set(notes) == {"memcheck", "racecheck", "initcheck", "synccheck"} and r.json["decision"]["data"]["sanitize"]
    rep = fl(repo, "report", OP, "--no-plots", "--json")  # (it refuses the claim here: the dispatch's bench
    assert rep.code in (0, 1), rep.stderr                 # left the tree's record without its gate)
    assert rep.json["explanation"]["_path"] == expl["_path"] and rep.json["records"]["explanation"] == expl["_path"]
    md = (ws(repo) / "report" / "REPORT.md").read_text()
    what = md.split("## What explains the win", 1)[1].split("\n## ", 1)[0]
    assert "`B2_T64_H2_D16/fwd`" in what and "`(host time outside any op)`" in what and "share explained" in what
    assert "Coverage: dense: " in md and "0 varlen cell(s)" in md
    assert not any("explanation" in x for x in rep.json["risks"])

    # a row typed over is reported by name, and only --restore renders over it (saving the edit)
    opt_log.write_text(opt_log.read_text().replace("| revert |", "| keep |", 1))
    r = fl(repo, "log", OP)
    assert r.code == 1 and "row 2" in r.stderr
    st = fl(repo, "status", OP, "--json").json
    assert [e["where"] for e in st["opt_log"]["hand_edits"]] == ["row 2"]
    r = fl(repo, "log", OP, "--restore", "--json")
    assert r.code == 0 and len(r.json["saved"]) == 1
    assert "| keep |" in Path(r.json["saved"][0]).read_text().split("| 2 |")[1].splitlines()[0]
    assert "| revert |" in opt_log.read_text().split("| 2 |")[1].splitlines()[0]


PROFILER_SHY = ("    import time; time.sleep(0.005)\n",
                # the sleep stays only while a profiler listens: the bench times the fast path, the
                # explanation's profile the slow one
                "    if torch.autograd.profiler._is_profiler_enabled:\n        import time; time.sleep(0.005)\n")


def test_the_go_needs_a_win_its_kernels_explain(slow_toy, tmp_path):
    repo = fresh_copy(slow_toy, tmp_path / "toy")
    edit(repo / FAST, *PROFILER_SHY)
    r, doc = iterate(repo, "sleep only when watched")
    assert r.code == 0 and doc["iteration"]["status"] == "keep", r.stderr  # the bench alone is fooled
    # taken before the go (the go reuses it); 20 steps a round, so that one step a loaded host
    # stretched does not carry a round's share past 50% and leave the profile "unsure"
    r = fl(repo, "explain", OP, "--json", "--steps", "20")
    assert r.code == 1 and r.json["blocked"], (r.json.get("total"), r.json.get("unsure"), r.stderr)
    assert any(f["rule"] == "unexplained-speedup" and "below 50%" in f["message"] for f in r.json["findings"])
    r2 = fl(repo, "stop", OP, "--go", "--json")
    assert r2.code == 1 and "missing: explained win" in r2.json["error"] and "unexplained-speedup" in r2.json["error"]
    assert r2.json["explanation"]["_path"] == r.json["_path"]  # the recorded explanation, not a new one
    assert not list((ws(repo) / "decisions").glob("*-stop.json"))  # nothing recorded
    rep = fl(repo, "report", OP, "--json", "--no-plots")
    assert rep.code == 1 and any(x["reason"] == "unexplained_speedup" for x in rep.json["refused"])


def test_drops_stall_the_loop_until_a_reassessment(slow_toy, tmp_path):
    repo = fresh_copy(slow_toy, tmp_path / "toy")

    # a candidate that is wrong only at the bench shape passes the gate; the bench's check blocks it
    edit(repo / FAST, *WRONG_AT_BENCH_SHAPE)
    r, doc = iterate(repo, "scale the output")
    assert r.code == 1
    one = doc["iteration"]
    assert one["status"] == "drop" and one["gate"]["green"] and one["guard"]["blocked"]
    assert any(f["cell"] == "B2_T64_H2_D16/fwd" and f["rule"] == "differs-from-base" and f["blocking"]
               for f in one["guard"]["findings"])
    assert one["revert_commit"] and git(repo, "diff", "HEAD~2", "HEAD") == ""

    # red gates: a row and a commit each (then reverted), no bench
    for n in (2, 3):
        edit(repo / FAST, *WRONG)
        r, doc = iterate(repo, f"wrong scale {n}")
        assert r.code == 1
        rec = doc["iteration"]
        assert rec["iter"] == n and rec["status"] == "drop" and not rec["gate"]["green"]
        assert rec["vs_best"] is None and rec["revert_commit"]
    assert len(log_lines(repo)) == 2 + 3 * 2  # two base commits + an attempt and its revert per iteration

    edit(repo / FAST, *WRONG)
    r = fl(repo, "iter", OP, "one more", *QUICK)
    assert r.code == 1 and "stalled" in r.stderr and "flaloop reassess" in r.stderr
    assert len(log_lines(repo)) == 8 and git(repo, "status", "--porcelain").strip()  # the edit is still there
    st = fl(repo, "status", OP, "--json").json
    assert st["phase"] == "stalled" and st["stall"]["count"] == 3 and st["counts"]["drop"] == 3

    r = fl(repo, "stop", OP, "--no-go", "--bound", "compute")
    assert r.code == 1 and "missing: bench evidence, named bound" in r.stderr
    assert "'compute' is not a limit flaloop measures" in r.stderr

    r = fl(repo, "reassess", OP, "--profiled", "py-spy: the einsum", "--tried", "output scaling",
           "--next", "fuse the tril", "--why", "the mask costs a pass")
    assert r.code == 0, r.stderr
    assert "#1 scale the output: drop" in r.stdout and "#3 wrong scale 3: drop" in r.stdout
    assert "### R1 after iteration 3" in (ws(repo) / "OPT_LOG.md").read_text()
    r, doc = iterate(repo, "one more")  # released
    assert doc["iteration"]["iter"] == 4 and doc["iteration"]["status"] == "drop"
    st = fl(repo, "status", OP, "--json").json
    assert st["stall"]["count"] == 1 and st["phase"] == "iterate" and st["iterations"] == 4


def test_iter_refuses_unsafe_repository_states_before_measuring(toy):
    repo = toy  # a contract, no baseline
    head = git(repo, "rev-parse", "HEAD").strip()

    r = fl(repo, "iter", OP, "nothing changed")
    assert r.code == 2 and "nothing to commit" in r.stderr
    edit(repo / FAST, "a = a.tril()", "a = a.tril()  # touched")
    r = fl(repo, "iter", OP, "too early")
    assert r.code == 2 and "no baseline" in r.stderr and f"flaloop baseline {OP}" in r.stderr
    git(repo, "checkout", "-q", "--", ".")

    git(repo, "checkout", "-q", "--detach")
    edit(repo / FAST, "a = a.tril()", "a = a.tril()  # touched")
    r = fl(repo, "iter", OP, "detached")
    assert r.code == 2 and "HEAD is detached" in r.stderr
    git(repo, "checkout", "-q", "main")

    git(repo, "checkout", "-q", "-b", "side")
    git(repo, "commit", "-qam", "side edit")
    git(repo, "checkout", "-q", "main")
    edit(repo / FAST, "a = a.tril()", "a = a.tril()  # other")
    git(repo, "commit", "-qam", "main edit")
    merge = subprocess.run(["git", "merge", "-q", "side"], cwd=repo, capture_output=True, env={**os.environ, **ENV})
    assert merge.returncode != 0  # a conflict: the merge stops half-way
    r = fl(repo, "iter", OP, "mid-merge")
    assert r.code == 2 and "a merge is in progress" in r.stderr
    git(repo, "merge", "--abort")

    git(repo, "checkout", "-q", "--orphan", "elsewhere")
    git(repo, "commit", "-qm", "unrelated root")
    edit(repo / FAST, "a = a.tril()", "a = a.tril()  # x")
    r = fl(repo, "iter", OP, "not from the base")
    assert r.code == 2 and "does not descend from the contract's base" in r.stderr
    assert not (ws(repo) / "iters").exists()
    assert git(repo, "rev-parse", "main~1").strip() == head  # no commit was made by any refusal


def test_a_revert_also_undoes_pending_signal_commits_and_skips_bytecode(tmp_path):
    from flaloop.core import git as git_mod

    repo = make_toy_repo(tmp_path / "toy")
    base = git(repo, "rev-parse", "HEAD").strip()
    cache = repo / "toyop" / "__pycache__"
    cache.mkdir()
    (cache / "fast.cpython-311.pyc").write_bytes(b"\x00bytecode")
    assert git_mod.changed_paths(repo) == []  # bytecode is never a change, even without a .gitignore
    edit(repo / FAST, "a = a.tril()", "a = a.tril()  # signal step")
    signal = git_mod.commit_all(repo, "signal iteration\n\nFlaloop-Iteration: 1\n")
    edit(repo / FAST, "a = a.tril()  # signal step", "a = a.tril()  # the candidate")
    cand = git_mod.commit_all(repo, "candidate\n\nFlaloop-Iteration: 2\n")
    assert git(repo, "show", "--name-only", "--format=", cand).split() == [str(FAST)]
    rev = git_mod.revert(repo, [cand, signal], "revert\n\nFlaloop-Iteration: 2\n")
    assert git_mod.same_tree(repo, rev, base) and git(repo, "status", "--porcelain") == "?? toyop/__pycache__/\n"
    assert [line.split(" ", 1)[1] for line in log_lines(repo)] == ["revert", "candidate", "signal iteration", "base"]
