"""What a gate costs with its pytest forked from the bench's warm fork server, against started fresh.

A gate without xdist workers forks its test process from the fork server a bench of the op left
(flaloop/task/pytest_run.py, `warm_server`). This times whole `flaloop gate OP --regate --json`
commands on a copy of examples/minifla, fresh and forked alternating (ABBA), each checked to have
run as asked (`run.forked`) and to be green. Before each fresh gate every fork server of the
copy's private directory is stopped; before each forked one a one-cell bench leaves one warm, as
the loop's bench does. Wall time only: a forked pytest is the server's child, not this script's.

On the CPU, under the Triton interpreter:

    TRITON_INTERPRET=1 python benchmarks/gate_forked.py --pairs 5 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OP = "chunk_linear_attn"
BENCH = ["--device", "cpu", "--min-pairs", "6", "--max-pairs", "6", "--rounds", "1", "--unseen-shapes", "0",
         "--modes", "fwd", "--shapes", "B1_T64_H2_D32"]


def _flaloop(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flaloop", *args], cwd=repo, capture_output=True, text=True)


def _repo(where: Path) -> Path:
    repo = where / "minifla"
    shutil.copytree(ROOT / "examples" / "minifla", repo,
                    ignore=shutil.ignore_patterns("__pycache__", "profile", ".pytest_cache"))
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@b"}
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(["git", *cmd], cwd=repo, env=env, check=True)
    for args in (["init", OP, "--shapes", "B1_T64_H2_D32", "--modes", "fwd"], ["gate", OP]):
        r = _flaloop(repo, *args)
        if r.returncode != 0:
            raise SystemExit(f"flaloop {' '.join(args)} failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
    return repo


def _leave_server(repo: Path) -> None:
    r = _flaloop(repo, "bench", OP, "--json", *BENCH)
    if r.returncode != 0:
        raise SystemExit(f"the bench that leaves a fork server failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
    # a bench whose workers imported more than its server preloaded leaves a new one preloading,
    # detached: a gate that finds none warm would run fresh
    time.sleep(10)


def _gate(repo: Path, forked: bool) -> float:
    t0 = time.perf_counter()
    r = _flaloop(repo, "gate", OP, "--json", "--regate")
    wall = time.perf_counter() - t0
    doc = json.loads(r.stdout or "{}")
    if r.returncode != 0 or not doc.get("green") or doc["run"]["forked"] != forked:
        raise SystemExit(f"a {'forked' if forked else 'fresh'} gate did not run as asked (exit {r.returncode}, "
                         f"forked {doc.get('run', {}).get('forked')}):\n{r.stderr[-2000:]}")
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=5, help="fresh/forked pairs, ABBA (default 5)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    work = Path(tempfile.mkdtemp(prefix="gate-forked-"))
    os.environ["XDG_CACHE_HOME"] = str(work / "xdg")  # its own preload lists and registry answers
    os.environ["FLALOOP_FORKSERVER_DIR"] = str(work / "fs")  # its own servers: stop_all stops only these
    sys.path.insert(0, str(ROOT))
    from flaloop.bench import forkservers

    walls: dict[str, list[float]] = {"fresh": [], "forked": []}
    try:
        repo = _repo(work)
        for i in range(args.pairs):
            for mode in ("fresh", "forked") if i % 2 == 0 else ("forked", "fresh"):
                if mode == "fresh":
                    forkservers.stop_all()
                else:
                    _leave_server(repo)
                walls[mode].append(_gate(repo, mode == "forked"))
                print(f"pair {i + 1}/{args.pairs} {mode}: {walls[mode][-1]:.2f} s", file=sys.stderr)
    finally:
        forkservers.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in walls.items()}
    out = {"pairs": args.pairs, "wall_s": {k: [round(x, 3) for x in v] for k, v in walls.items()},
           "median_s": {k: round(v, 3) for k, v in med.items()},
           "saved_s": round(med["fresh"] - med["forked"], 3), "ratio": round(med["fresh"] / med["forked"], 3)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k in ("fresh", "forked"):
            print(f"{k:7s} median {med[k]:.2f} s  ({', '.join(f'{x:.2f}' for x in walls[k])})")
        print(f"saved   {out['saved_s']:.2f} s a gate; fresh/forked {out['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
