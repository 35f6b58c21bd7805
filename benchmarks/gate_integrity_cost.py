"""What the gate's in-memory integrity checks (docs/GUARD.md, gate-tampered) add to a gate's time.

Runs the op's frozen test file the way `flaloop gate` does (pytest with flaloop's plugin, through
a neutral symlink) with the checks on and off, alternating, and prints the median wall time of
each and their ratio. On the CPU it uses a copy of examples/minifla (TRITON_INTERPRET=1):

    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/gate_integrity_cost.py --rounds 3

On the H200 with FLA at .fla/ (one op's test file, as its contract freezes it):

    PYTHONPATH=.:.fla python benchmarks/gate_integrity_cost.py --repo .fla --op chunk_gla --rounds 3

The checks are on when the plugin is told the tree and the frozen files (FLALOOP_GATE_TREE,
FLALOOP_GATE_FROZEN), as the gate does; off, the plugin only observes.
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
PLUGIN_DIR = ROOT / "flaloop" / "inside" / "scripts"


def _repo(args) -> tuple[Path, str, list[str]]:
    """The repo, the op's test file and the frozen files, from a contract `flaloop init` writes."""
    if args.repo:
        repo = Path(args.repo).resolve()
    else:
        repo = Path(tempfile.mkdtemp(prefix="flaloop-cost-")) / "minifla"
        shutil.copytree(ROOT / "examples" / "minifla", repo, ignore=shutil.ignore_patterns("__pycache__"))
        env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t"}
        for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "base"]):
            subprocess.run(cmd, cwd=repo, check=True, env=env)
    contract = repo / "profile" / f"{args.op}-opt" / "contract.json"
    if not contract.exists():
        subprocess.run([sys.executable, "-m", "flaloop", "init", args.op, "--repo", str(repo), "--json"],
                       check=True, capture_output=True)
    doc = json.loads(contract.read_text())
    return repo, doc["test_file"], [f["path"] for f in doc["frozen"]]


def _once(repo: Path, test_file: str, frozen: list[str], checks: bool) -> tuple[float, int, float]:
    tmp = Path(tempfile.mkdtemp(prefix="flaloop-gate-"))
    try:
        link = tmp / "tree"
        os.symlink(repo, link)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLALOOP_GATE_")}
        env["PYTHONPATH"] = os.pathsep.join([str(PLUGIN_DIR), str(link)] + ([env["PYTHONPATH"]] if env.get(
            "PYTHONPATH") else []))
        env["FLALOOP_GATE_EVENTS"] = str(tmp / "events.jsonl")
        if checks:
            env["FLALOOP_GATE_TREE"], env["FLALOOP_GATE_FROZEN"] = str(link), os.pathsep.join(frozen)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", str(link / test_file), f"--rootdir={link}", "-p",
                               "flaloop_gate_plugin", "-p", "no:cacheprovider", "-q"], cwd=tmp, env=env,
                              capture_output=True, text=True)
        wall = time.monotonic() - t0
        events = [json.loads(line) for line in (tmp / "events.jsonl").read_text().splitlines() if line]
        changes = sum(len(e.get("changes") or []) for e in events)
        if proc.returncode != 0 or changes:
            raise SystemExit(f"pytest exited {proc.returncode} with {changes} change(s):\n{proc.stdout[-3000:]}")
        return wall, max([e.get("checks", 0) for e in events] or [0]), max(
            [e.get("check_s", 0.0) for e in events] or [0.0])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", help="a repo with a contract for --op (default: a copy of examples/minifla)")
    ap.add_argument("--op", default="chunk_linear_attn")
    ap.add_argument("--rounds", type=int, default=3, help="pairs of runs, on and off alternating")
    args = ap.parse_args()
    repo, test_file, frozen = _repo(args)
    try:
        _measure(args, repo, test_file, frozen)
    finally:
        if not args.repo:  # the copy of examples/minifla made for this run
            shutil.rmtree(repo.parent, ignore_errors=True)


def _measure(args, repo: Path, test_file: str, frozen: list[str]) -> None:
    _once(repo, test_file, frozen, checks=False)  # compiles and warms the caches for both
    on, off, checks, check_s = [], [], 0, []
    for i in range(args.rounds):
        for flag in ((True, False) if i % 2 == 0 else (False, True)):
            wall, n, secs = _once(repo, test_file, frozen, flag)
            (on if flag else off).append(wall)
            checks = max(checks, n)
            if flag:
                check_s.append(secs)
    result = {"test_file": test_file, "rounds": args.rounds, "on_s": [round(x, 2) for x in on],
              "off_s": [round(x, 2) for x in off], "median_on_s": round(statistics.median(on), 2),
              "median_off_s": round(statistics.median(off), 2),
              "ratio": round(statistics.median(on) / statistics.median(off), 3), "checks": checks,
              # inside the test process: the snapshot and every check, the part that noise cannot hide
              "median_check_s": round(statistics.median(check_s), 3),
              "check_share": round(statistics.median(check_s) / statistics.median(on), 3)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
