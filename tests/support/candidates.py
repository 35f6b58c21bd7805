"""The candidates the sweep tests measure on examples/minifla (an honest speedup, a neutral change,
a cheat the guard names, one that does not import) and how the tests call and read a sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.cli import flaloop
from support.repos import GIT_ENV, INIT_ARGS, OP, edit, git

CHUNK = Path("minifla/ops/linear_attn/chunk.py")
FUSED = Path("minifla/ops/linear_attn/fused_recurrent.py")
# the unseen-shapes check is off here (it has its own tests, tests/e2e/test_unseen.py): the suite's time
QUICK = ["--modes", "fwd", "--min-pairs", "4", "--max-pairs", "8", "--rounds", "1", "--cell-seconds", "20", "--unseen-shapes", "0"]
# A planted slowdown of the chunked op that no machine's noise can hide: a sleep longer than one
# interpreted call (at B1_T64_H2_D32 on the 2-core CPU: 11.5 ms idle, 47 ms with a load average of
# 5.5), so a verdict of SLOWER is the mechanism under test, not a draw of the CPU's load. It is
# also a wait every call of the base pays outside the timed samples (set-up, probes, replays: ~300
# calls in test_iter_from_sweep), so it is no longer than the ranking needs: with 60 ms, two sweep
# modules beside each other read honest 2.9x and 6.1x, neutral 1.047x and 0.993x.
SLOWER_CHUNK = ("    _, T, H, K = q.shape\n", "    _, T, H, K = q.shape\n    import time; time.sleep(0.06)\n")
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


def branch(repo: Path, name: str, path: Path, old: str, new: str, *more: tuple[str, str]) -> str:
    """A branch off main with one edit (and `more`, each an (old, new) of the same file), committed;
    main stays checked out."""
    git(repo, "checkout", "-q", "-b", name)
    for o, n in ((old, new), *more):
        edit(repo / path, o, n)
    git(repo, "commit", "-qam", name)
    git(repo, "checkout", "-q", "main")
    return git(repo, "rev-parse", name).strip()


def make_candidates(repo: Path) -> Path:
    """Four branches off main: honest (chunks of 64: half the sequential steps), neutral (a comment),
    cheat (zeros at the bench's shape and dtype), broken (an import that fails).

    main first gets a chunked op that sleeps on every call (SLOWER_CHUNK) and becomes the contract's
    base; honest also drops the sleep. The sleep dominates each timed call, so the honest change wins by
    several times what a loaded 2-core CPU can move, and the neutral one reads near 1 under any load:
    the ranking below is the sweep's, never a draw of the machine's noise (with chunks of 64 alone,
    ~1.45x, a few pairs under a full suite's load once ranked the neutral change first)."""
    edit(repo / CHUNK, *SLOWER_CHUNK)
    git(repo, "commit", "-qam", "a sleeping chunked op")
    # fwd only, as every sweep here measures (QUICK): `baseline` and `iter` bench the contract's cells
    r = flaloop(repo, "init", OP, "--force", *INIT_ARGS, "--modes", "fwd")
    assert r.code == 0, r.stderr
    branch(repo, "honest", CHUNK, "CHUNK_SIZE = 32", "CHUNK_SIZE = 64", (SLOWER_CHUNK[1], SLOWER_CHUNK[0]))
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
    # the base sleeps 60 ms a call and honest does not (make_candidates): a few pairs on a loaded
    # 2-core CPU may still leave the verdict UNSURE, never the ranking
    assert honest["rank"] == 1 and honest["status"] == "ok" and honest["verdict"] in ("FASTER", "UNSURE")
    assert honest["geomean"]["speedup"] > 1.1
    # the neutral change sleeps as the base does, which is most of each call: near 1 under any load
    assert neutral["rank"] == 2 and neutral["status"] == "ok", neutral
    assert 0.75 < neutral["geomean"]["speedup"] < 1.33, neutral["geomean"]
    assert cheat["status"] == "blocked" and cheat["rank"] is None and "shape-branch" in cheat["reason"]
    assert cheat["gate"] is None and cheat["record"] is None  # the static rules stopped it: no gate, no bench
    assert broken["status"] == "failed" and broken["rank"] is None
    assert "could not test it" in broken["reason"] and "no_such_module_anywhere" in broken["reason"]
    assert honest["gate"]["green"] is True and broken["gate"]["green"] is False




SLEEPY = ("    _, T, H, K = q.shape\n",
          "    _, T, H, K = q.shape\n"
          "    import os, time\n"
          "    if os.environ.get('SWEEP_MARK'):\n"
          "        open(os.environ['SWEEP_MARK'], 'a').write('running\\n')\n"
          "        time.sleep(120)\n")


def sleepy_branch(repo: Path) -> None:
    """A candidate whose op sleeps two minutes (once SWEEP_MARK names a file it writes to first)."""
    branch(repo, "sleepy", CHUNK, *SLEEPY)


def start_sweep(repo: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`flaloop sweep OP ARGS --json` with the quick settings, as a process the test can signal."""
    return subprocess.Popen([sys.executable, "-m", "flaloop", "sweep", OP, *args, "--json", *QUICK], cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1", **GIT_ENV, **(env or {})})
