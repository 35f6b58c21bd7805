"""`flaloop sweep` with the local executor on examples/minifla (Triton interpreter): four candidates
ranked, bad input named while the others run, and `iter --from-sweep`. Every CLI call is checked by
support.cli.flaloop() to leave the user's branch, index, files, stash and worktrees as they were."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from support.candidates import QUICK, check_ranking, rows, sleepy_branch, start_sweep, sweep
from support.cli import flaloop
from support.procs import alive, descendants, fork_servers, wait_for
from support.repos import OP, fresh_copy, git, worktrees


@pytest.fixture(scope="module")
def ranked(prepared_candidates, tmp_path_factory):
    """The four candidates swept (`flaloop sweep --json`): the repo (copy it, don't edit it), its HEAD
    before the sweep, the run and its document."""
    repo = fresh_copy(prepared_candidates, tmp_path_factory.mktemp("ranked") / "minifla")
    head = git(repo, "rev-parse", "HEAD").strip()
    r, doc = sweep(repo, OP, "--candidates", "honest", "neutral", "cheat", "broken")
    return repo, head, r, doc


def test_a_local_sweep_ranks_the_honest_candidate_first_blocks_the_cheat_and_fails_the_broken_one(ranked, tmp_path):
    repo, head, r, doc = ranked
    assert r.code == 3, r.stderr[-3000:]  # a candidate could not be measured; the others' results stand
    check_ranking(doc)
    assert doc["executor"]["kind"] == "local" and doc["executor"]["slots"] == 1  # the CPU: one at a time
    sweep_dir = Path(doc["path"]).parent
    assert (sweep_dir / "sweep.md").is_file() and (sweep_dir / "sweep.png").stat().st_size > 1000
    honest = rows(doc)["honest"]
    rec = json.loads((sweep_dir / honest["record"]).read_text())
    assert rec["candidate"]["commit"] == git(repo, "rev-parse", "honest").strip()
    assert rec["gate"]["green"] is True and rec["unverified"] is False
    # the table says what the record says (check_ranking allows UNSURE on a loaded CPU, never another rank)
    assert f"| 1 | honest | ok | {honest['verdict']} |" in (sweep_dir / "sweep.md").read_text()
    # a sweep never commits or moves the branch (flaloop() checked the files, index and worktrees)
    assert git(repo, "rev-parse", "HEAD").strip() == head and git(repo, "branch", "--show-current").strip() == "main"
    # the human table says the same, and where to go next (in a copy: the sweep above stays the only one)
    human = flaloop(fresh_copy(repo, tmp_path / "minifla"), "sweep", OP, "--candidates", "honest,cheat", *QUICK)
    assert human.code == 0, human.stderr[-2000:]
    assert "honest" in human.stdout and "BLOCKED" in human.stdout and "--from-sweep" in human.stdout


def test_bad_candidates_are_named_and_the_others_still_run(candidates, tmp_path):
    repo = candidates
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "a-good.diff").write_text(git(repo, "diff", "main", "honest"))
    (patches / "b-stale.diff").write_text("--- a/minifla/ops/linear_attn/chunk.py\n+++ b/minifla/ops/linear_attn/chunk.py\n"
                                          "@@ -1,1 +1,1 @@\n-this line is not in the file\n+nor is this one\n")
    r, doc = sweep(repo, OP, "--candidates", "no-such-branch", "main", "honest", "honest~0", "--patches", str(patches))
    assert r.code == 2, r.stderr[-3000:]
    got = {c["ref"]: c for c in doc["candidates"]}
    assert "unknown ref 'no-such-branch'" in got["no-such-branch"]["reason"] and got["no-such-branch"]["invalid"]
    assert "its tree is the base's" in got["main"]["reason"]
    assert "the same tree as honest" in got["honest~0"]["reason"]
    stale = got[str(patches / "b-stale.diff")]
    assert stale["invalid"] and "does not apply" in stale["reason"]
    # the sound ones ran: the branch, and the patch that is the same change (another name, one tree)
    assert got["honest"]["status"] == "ok" and got["honest"]["rank"] == 1
    assert "the same tree as honest" in got[str(patches / "a-good.diff")]["reason"]
    # refused before anything runs
    too_many = flaloop(repo, "sweep", OP, "--candidates", "honest", "neutral", "cheat", "--max-candidates", "2")
    assert too_many.code == 2 and "3 candidates, more than --max-candidates 2" in too_many.stderr
    unreachable = flaloop(repo, "sweep", OP, "--candidates", "honest", "--executor", "ray", "--address", "127.0.0.1:9")
    assert unreachable.code == 2 and "could not reach the Ray cluster at '127.0.0.1:9'" in unreachable.stderr
    no_ray = tmp_path / "no-ray"
    (no_ray / "ray").mkdir(parents=True)
    (no_ray / "ray" / "__init__.py").write_text("raise ImportError('ray is not installed here')\n")
    missing = flaloop(repo, "sweep", OP, "--candidates", "honest", "--executor", "ray",
                      env={"PYTHONPATH": f"{no_ray}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert missing.code == 2 and "pip install 'flaloop[ray]'" in missing.stderr
    mixed = flaloop(repo, "sweep", "--ops", "changed", "--candidates", "honest", "--base", "main")
    assert mixed.code == 2 and "takes no OP, --candidates or --patches" in mixed.stderr


def test_iter_from_sweep_puts_the_candidate_in_the_working_tree_and_keeps_it(ranked, tmp_path):
    swept, _, _, doc = ranked  # honest measured, cheat blocked
    assert rows(doc)["honest"]["status"] == "ok" and rows(doc)["cheat"]["status"] == "blocked"
    repo = fresh_copy(swept, tmp_path / "minifla")
    sweep_dir = str(repo / Path(doc["path"]).parent.relative_to(swept))
    assert flaloop(repo, "baseline", OP, *QUICK[2:]).code == 0
    # a blocked candidate is not iterated, and the working tree is not touched
    refused = flaloop(repo, "iter", OP, "--from-sweep", sweep_dir, "cheat", *QUICK[2:])
    assert refused.code == 2 and "cheat was blocked in that sweep" in refused.stderr
    (repo / "scratch.txt").write_text("the user's own work\n")
    dirty = flaloop(repo, "iter", OP, "--from-sweep", sweep_dir, "honest", *QUICK[2:])
    assert dirty.code == 2 and "uncommitted changes" in dirty.stderr
    assert (repo / "scratch.txt").read_text() == "the user's own work\n"
    (repo / "scratch.txt").unlink()
    it = flaloop(repo, "iter", OP, "--from-sweep", Path(sweep_dir).name, "honest", "--json", *QUICK[2:])
    assert it.code == 0, it.stderr[-3000:]
    doc = it.json
    assert doc["iteration"]["status"] == "keep" and doc["iteration"]["source"]["ref"] == "honest"
    assert "from sweep" in doc["row"] and "honest" in doc["row"]
    msg = git(repo, "log", "-1", "--format=%B")
    assert "Flaloop-Sweep: " in msg and git(repo, "rev-parse", "honest").strip() in msg
    assert git(repo, "diff", "HEAD", "honest").strip() == ""  # the committed change is the candidate's
    # clean keeps the sweep the iteration came from, and takes an uncited one with its refs
    r, other = sweep(repo, OP, "--candidates", "cheat")
    assert r.code == 0 and other["candidates"][0]["status"] == "blocked"
    stamp = Path(other["path"]).parent.name
    assert git(repo, "for-each-ref", f"refs/flaloop/sweeps/{stamp}/")
    cleaned = flaloop(repo, "clean", OP, "--keep", "0", "--json")
    assert cleaned.code == 0, cleaned.stderr
    assert f"sweeps/{Path(sweep_dir).name}" in cleaned.json["cited"] and f"sweeps/{stamp}" in cleaned.json["removed"]
    assert not git(repo, "for-each-ref", f"refs/flaloop/sweeps/{stamp}/").strip()
    assert Path(sweep_dir).is_dir() and not Path(other["path"]).exists()


def test_ctrl_c_withdraws_the_sweep_and_leaves_no_worktree_or_process(candidates, tmp_path):
    repo = candidates
    sleepy_branch(repo)
    mark = tmp_path / "mark"
    proc = start_sweep(repo, "--candidates", "sleepy", "honest", env={"SWEEP_MARK": str(mark)})
    try:
        assert wait_for(lambda: mark.exists(), 120), "the sleepy candidate's gate never ran its op"
        below = descendants(proc.pid)
        below = [p for p in below if p not in fork_servers(below)]  # a gate's warm server stays
        assert below and len(worktrees(repo)) >= 2  # pytest running in the candidate's worktree
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    except BaseException:
        proc.kill()
        raise
    assert proc.returncode == 130, err[-3000:]
    doc = json.loads(out)
    assert doc["error"] == "interrupted" and doc["exit_code"] == 130
    rec = json.loads(Path(doc["record"]).read_text())  # the sweep record, kept
    assert rec["interrupted"] is True and {r["ref"] for r in rec["rows"]} == {"sleepy", "honest"}
    assert worktrees(repo) == [str(repo)]
    assert wait_for(lambda: not [p for p in below if alive(p)], 10), "a gate or worker outlived the sweep"
