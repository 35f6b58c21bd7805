"""`flaloop sweep` as a user meets it on examples/minifla (Triton interpreter): four candidates (an
honest speedup, a neutral change, a cheat the guard names, one that does not import) ranked with
the local executor and on a real local Ray cluster (one of whose workers is killed mid-task), the
pull-request check `--ops changed`, bad input, and `iter --from-sweep`. Every CLI call is checked
by conftest.flaloop() to leave the user's branch, index, files, stash and worktrees as they were."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import GIT_ENV, OP, assert_user_state_kept, edit, flaloop, git, user_state, wait_for, worktrees

CHUNK = Path("minifla/ops/linear_attn/chunk.py")
FUSED = Path("minifla/ops/linear_attn/fused_recurrent.py")
QUICK = ["--modes", "fwd", "--min-pairs", "4", "--max-pairs", "6", "--rounds", "1", "--cell-seconds", "20"]
CHEAT = ("    _, T, H, K = q.shape\n",
         "    _, T, H, K = q.shape\n    if q.dtype == torch.bfloat16 and T == 64:\n        return torch.zeros_like(v), None\n")


# A planted slowdown of the recurrent op: its forward kernel twice more, same results.
SLOWER_FUSED = """        for _ in range(2):
            fused_recurrent_linear_attn_fwd_kernel[(triton.cdiv(V, BV), N * H)](
                q, k, v, o, initial_state, ht, cu_seqlens, scale, T, H=H, K=K, V=V, T_MAX=max_len, BK=BK, BV=BV,
                USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state,
                IS_VARLEN=cu_seqlens is not None)
        ctx.save_for_backward(q, k, v, initial_state, cu_seqlens)
"""


def branch(repo: Path, name: str, path: Path, old: str, new: str) -> str:
    """A branch off main with one edit, committed; main stays checked out."""
    git(repo, "checkout", "-q", "-b", name)
    edit(repo / path, old, new)
    git(repo, "commit", "-qam", name)
    git(repo, "checkout", "-q", "main")
    return git(repo, "rev-parse", name).strip()


@pytest.fixture
def candidates(repo) -> Path:
    branch(repo, "honest", CHUNK, "CHUNK_SIZE = 32", "CHUNK_SIZE = 64")
    branch(repo, "neutral", CHUNK, "CHUNK_SIZE = 32", "CHUNK_SIZE = 32  # tiles of 32 timesteps")
    branch(repo, "cheat", CHUNK, *CHEAT)
    branch(repo, "broken", CHUNK, "import torch\n", "import torch\nimport no_such_module_anywhere\n")
    return repo


def sweep(repo: Path, *args: str, env: dict | None = None, timeout: float = 600):
    r = flaloop(repo, "sweep", *args, "--json", *QUICK, env=env, timeout=timeout)
    return r, (json.loads(r.stdout) if r.stdout.strip() else {})


def rows(doc: dict) -> dict[str, dict]:
    return {c["ref"]: c for c in doc["candidates"]}


def check_ranking(doc: dict) -> None:
    got = rows(doc)
    assert [c["ref"] for c in doc["candidates"]][:2] == ["honest", "neutral"]
    honest, neutral, cheat, broken = (got[k] for k in ("honest", "neutral", "cheat", "broken"))
    assert honest["rank"] == 1 and honest["status"] == "ok" and honest["verdict"] == "FASTER"
    assert honest["geomean"]["ci_low"] > 1.1
    # the neutral change measures near 1 (a few pairs on a shared 2-core CPU may still call a few % either way)
    assert neutral["rank"] == 2 and neutral["status"] == "ok" and 0.85 < neutral["geomean"]["speedup"] < 1.15
    assert cheat["status"] == "blocked" and cheat["rank"] is None and "shape-branch" in cheat["reason"]
    assert cheat["gate"] is None and cheat["record"] is None  # the static rules stopped it: no gate, no bench
    assert broken["status"] == "failed" and broken["rank"] is None
    assert "could not test it" in broken["reason"] and "no_such_module_anywhere" in broken["reason"]
    assert honest["gate"]["green"] is True and broken["gate"]["green"] is False


def test_a_local_sweep_ranks_the_honest_candidate_first_blocks_the_cheat_and_fails_the_broken_one(candidates):
    repo = candidates
    head = git(repo, "rev-parse", "HEAD").strip()
    r, doc = sweep(repo, OP, "--candidates", "honest", "neutral", "cheat", "broken")
    assert r.code == 3, r.stderr[-3000:]  # a candidate could not be measured; the others' results stand
    check_ranking(doc)
    assert doc["executor"]["kind"] == "local" and doc["executor"]["slots"] == 1  # the CPU: one at a time
    sweep_dir = Path(doc["path"]).parent
    assert (sweep_dir / "sweep.md").is_file() and (sweep_dir / "sweep.png").stat().st_size > 1000
    honest = rows(doc)["honest"]
    rec = json.loads((sweep_dir / honest["record"]).read_text())
    assert rec["candidate"]["commit"] == git(repo, "rev-parse", "honest").strip()
    assert rec["gate"]["green"] is True and rec["unverified"] is False
    assert "| 1 | honest | ok | FASTER |" in (sweep_dir / "sweep.md").read_text()
    # a sweep never commits or moves the branch (flaloop() checked the files, index and worktrees)
    assert git(repo, "rev-parse", "HEAD").strip() == head and git(repo, "branch", "--show-current").strip() == "main"
    # the human table says the same, and where to go next
    human = flaloop(repo, "sweep", OP, "--candidates", "honest,cheat", *QUICK)
    assert human.code == 0, human.stderr[-2000:]
    assert "honest" in human.stdout and "BLOCKED" in human.stdout and "--from-sweep" in human.stdout


def _ray_procs() -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/cmdline").read_bytes().startswith(b"ray::flaloop_measure"):
                    out.append(int(entry))
            except OSError:
                continue
    return out


def test_a_ray_sweep_ranks_the_same_and_a_killed_worker_is_retried(candidates):
    repo = candidates
    before = user_state(repo)
    env = {**os.environ, "TRITON_INTERPRET": "1", **GIT_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "flaloop", "sweep", OP, "--candidates", "honest", "neutral",
                             "cheat", "broken", "--executor", "ray", "--json", *QUICK], cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        victim = wait_for(_ray_procs, 180, step=0.05)
        assert victim, "no Ray task ever ran"
        time.sleep(1.0)  # inside the job now: its clone, its gate
        os.kill(victim[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=600)
    except BaseException:
        proc.kill()
        raise
    assert_user_state_kept(repo, before, ["sweep"], proc.pid)
    assert proc.returncode == 3, err[-3000:]
    doc = json.loads(out)
    assert doc["executor"]["kind"] == "ray" and doc["executor"]["address"] == "local instance"
    check_ranking(doc)
    retried = [c for c in doc["candidates"] if c["attempts"] == 2]
    assert len(retried) == 1 and "WorkerCrashedError" in retried[0]["reason"], doc["candidates"]
    assert retried[0]["status"] in ("ok", "failed") and retried[0]["ref"] in ("honest", "neutral", "broken")
    assert worktrees(repo) == [str(repo)]
    assert not _ray_procs()  # the local Ray instance is gone with the sweep


def test_ops_changed_benches_only_the_op_whose_code_the_diff_touches(repo):
    base = git(repo, "rev-parse", "HEAD").strip()
    # a change to the chunk kernel: chunk_linear_attn's code, not fused_recurrent_linear_attn's
    edit(repo / CHUNK, "CHUNK_SIZE = 32", "CHUNK_SIZE = 64")
    git(repo, "commit", "-qam", "bigger chunks")
    r, doc = sweep(repo, "--ops", "changed", "--base", base, "--shapes", "B1_T64_H2_D32")
    assert r.code == 0, r.stderr[-3000:]
    assert [c["op"] for c in doc["candidates"]] == [OP]
    assert doc["candidates"][0]["verdict"] == "FASTER" and doc["sweep"] == "ops"
    assert "chunk_linear_attn: the change touches minifla/ops/linear_attn/chunk.py" in r.stderr
    # a slower change to the other op only: the check names it, and exits 1
    edit(repo / FUSED, "        ctx.save_for_backward(q, k, v, initial_state, cu_seqlens)\n", SLOWER_FUSED)
    git(repo, "commit", "-qam", "slower recurrence")
    r, doc = sweep(repo, "--ops", "changed", "--base", "HEAD~1", "--shapes", "B1_T64_H2_D32")
    assert [c["op"] for c in doc["candidates"]] == ["fused_recurrent_linear_attn"], r.stderr[-2000:]
    assert r.code == 1 and doc["candidates"][0]["slower"], doc["candidates"][0]
    # a diff that touches no op's code measures nothing
    (repo / "NOTES.md").write_text("notes\n")
    git(repo, "add", "NOTES.md")
    git(repo, "commit", "-qm", "notes")
    r, doc = sweep(repo, "--ops", "changed", "--base", "HEAD~1")
    assert r.code == 0 and doc["candidates"] == []


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


def test_iter_from_sweep_puts_the_candidate_in_the_working_tree_and_keeps_it(candidates):
    repo = candidates
    r, doc = sweep(repo, OP, "--candidates", "honest", "cheat")
    assert r.code == 0, r.stderr[-3000:]
    sweep_dir = str(Path(doc["path"]).parent)
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
