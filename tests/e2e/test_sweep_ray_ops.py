"""`flaloop sweep` on a real local Ray cluster (one of whose task processes is killed mid-task), and
the pull-request check `--ops changed`, on examples/minifla (Triton interpreter)."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

from support.candidates import (
    CHUNK,
    FUSED,
    SLOWER_CHUNK,
    SLOWER_FUSED,
    check_ranking,
    sleepy_branch,
    start_sweep,
    sweep,
)
from support.procs import wait_for
from support.repos import OP, edit, git, worktrees
from support.userstate import assert_user_state_kept, user_state

REGISTRY = Path("benchmarks/ops/registry.py")
TINY = "B1_T16_H1_D16"


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
    proc = start_sweep(repo, "--candidates", "honest", "neutral", "cheat", "broken", "--executor", "ray")
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


def test_ctrl_c_cancels_every_ray_task(candidates, tmp_path):
    repo = candidates
    sleepy_branch(repo)
    mark = tmp_path / "mark"
    proc = start_sweep(repo, "--candidates", "sleepy", "--executor", "ray", env={"SWEEP_MARK": str(mark)})
    try:
        assert wait_for(lambda: mark.exists(), 180), "the sleepy candidate's gate never ran its op on Ray"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    except BaseException:
        proc.kill()
        raise
    assert proc.returncode == 130, err[-3000:]
    assert json.loads(out)["error"] == "interrupted"
    assert wait_for(lambda: not _ray_procs(), 20), "a Ray task outlived the sweep"
    assert worktrees(repo) == [str(repo)]
    node = Path(tempfile.gettempdir()) / f"flaloop-ray-{os.getuid()}"
    assert not (node.exists() and any(node.glob("*/*"))), "a Ray task's directory was left behind"


def test_ops_changed_benches_only_the_op_whose_code_the_diff_touches(repo):
    # A shape of 16 timesteps and one head in the repo's registry: the recurrent op steps through T
    # one timestep at a time, and interpreted at B1_T64_H2_D32 its forward takes 0.3 s a call on the
    # 2-core CPU, 0.04 s at this shape (docs/lab/2026-12-04-cpu.md R30); what this test checks is
    # which op is benched, not at what size.
    edit(repo / REGISTRY, "    # CPU-friendly\n", "    # CPU-friendly\n    'B1_T16_H1_D16': {'B': 1, 'T': 16, 'H': 1, 'D': 16},\n")
    # a base whose chunked op sleeps, so that the change below is faster whatever the CPU's load
    edit(repo / CHUNK, *SLOWER_CHUNK)
    git(repo, "commit", "-qam", "a sleeping chunked op")
    base = git(repo, "rev-parse", "HEAD").strip()
    # a change to the chunk kernel: chunk_linear_attn's code, not fused_recurrent_linear_attn's
    edit(repo / CHUNK, "CHUNK_SIZE = 32", "CHUNK_SIZE = 64")
    edit(repo / CHUNK, SLOWER_CHUNK[1], SLOWER_CHUNK[0])
    git(repo, "commit", "-qam", "bigger chunks")
    r, doc = sweep(repo, "--ops", "changed", "--base", base, "--shapes", TINY)
    assert r.code == 0, r.stderr[-3000:]
    assert [c["op"] for c in doc["candidates"]] == [OP]
    assert doc["candidates"][0]["geomean"]["speedup"] > 1.1 and doc["sweep"] == "ops"
    assert "chunk_linear_attn: the change touches minifla/ops/linear_attn/chunk.py" in r.stderr
    # a slower change to the other op only: the check names it, and exits 1
    edit(repo / FUSED, "        ctx.save_for_backward(q, k, v, initial_state, cu_seqlens)\n", SLOWER_FUSED)
    git(repo, "commit", "-qam", "slower recurrence")
    r, doc = sweep(repo, "--ops", "changed", "--base", "HEAD~1", "--shapes", TINY)
    assert [c["op"] for c in doc["candidates"]] == ["fused_recurrent_linear_attn"], r.stderr[-2000:]
    assert r.code == 1 and doc["candidates"][0]["slower"], doc["candidates"][0]
    # a diff that touches no op's code measures nothing
    (repo / "NOTES.md").write_text("notes\n")
    git(repo, "add", "NOTES.md")
    git(repo, "commit", "-qm", "notes")
    r, doc = sweep(repo, "--ops", "changed", "--base", "HEAD~1")
    assert r.code == 0 and doc["candidates"] == []


