"""Do long runs leak? N benches of one op in one process, with counts before and after.

Usage: leak_check.py [--n 50] [--repo PATH --op OP] [--json]

Without --repo it builds the pure-torch toy target of tests/support/toy/ in a temp dir (fast on a
CPU). The benches run in this process (as the loop's commands do), on the CPU timer, one shape,
fwd only, one round. Counted before the first bench (`start`), after a first bench that
warms up caches and lazy imports (`base`), and after N more (`after`):

  processes        living processes with this run's private TMPDIR in their environment: the
                   workers, pytest, probes, orphaned or not
  forkservers      warm fork servers the benches left (one is meant to stay: more is a leak)
  fds              open file descriptors of this process
  threads          Python threads of this process
  worktrees        entries of `git worktree list`
  tmp_entries      flaloop-* entries in the private TMPDIR
  workspace_bytes  the op's workspace (profile/<op>-opt/); `per_run_bytes` is its growth per bench

Exit 1 when any count but workspace_bytes grew from `base` to `after`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COUNTS = ("processes", "forkservers", "fds", "threads", "worktrees", "tmp_entries")


def our_processes(tmpdir: str, forkservers: bool = False) -> list[int]:
    """This run's living processes; the warm fork servers it left (meant to stay) only when asked."""
    marker = f"TMPDIR={tmpdir}\0".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            server = b"--forkserver" in Path(f"/proc/{entry}/cmdline").read_bytes()
            if marker in Path(f"/proc/{entry}/environ").read_bytes() and server == forkservers:
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    out.append(int(entry))
        except (OSError, IndexError):
            continue
    return out


def snapshot(target, op: str, tmpdir: str) -> dict:
    from flaloop.core import git

    return {"processes": len(our_processes(tmpdir)), "fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(), "worktrees": len(git.list_worktrees(target.root)),
            "tmp_entries": sum(1 for e in os.listdir(tmpdir) if e.startswith("flaloop-") and not e.startswith("flaloop-fs-")),
            "forkservers": len(our_processes(tmpdir, forkservers=True)),
            "workspace_bytes": target.workspace(op).usage()["total"]}


def settled(target, op: str, tmpdir: str, base: dict | None, wait_s: float = 10.0) -> dict:
    """A snapshot, after giving exiting children and their log threads a moment to finish."""
    deadline = time.monotonic() + wait_s
    while True:
        snap = snapshot(target, op, tmpdir)
        if base is None or all(snap[k] <= base[k] for k in COUNTS) or time.monotonic() > deadline:
            return snap
        time.sleep(0.2)


def toy_repo(where: Path) -> tuple[Path, str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from support.repos import make_toy_repo

    repo = make_toy_repo(where / "toy")
    subprocess.run([sys.executable, "-m", "flaloop", "init", "toy_attn", "--shapes", "B2_T64_H2_D16", "--modes", "fwd"],
                   cwd=repo, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return repo, "toy_attn"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--repo")
    ap.add_argument("--op")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="leakcheck-"))
    tmpdir = scratch / "tmp"
    tmpdir.mkdir()
    os.environ["TMPDIR"] = str(tmpdir)  # every child inherits it: that is how we find them
    tempfile.tempdir = None
    os.environ.setdefault("TRITON_INTERPRET", "1")
    repo, op = (Path(args.repo).resolve(), args.op) if args.repo else toy_repo(scratch)

    from flaloop.bench import run
    from flaloop.bench.model import BenchConfig
    from flaloop.task.contract import Contract
    from flaloop.task.target import Target

    target = Target.discover(repo)
    contract = Contract.load(target, op)

    def one() -> None:
        cfg = BenchConfig(device="cpu", modes=["fwd"], rounds=1, max_rounds=1, min_pairs=4, max_pairs=6,
                          cell_seconds=10, sample_ms=1.0)
        rec = run.bench(target, contract, base_ref=None, shapes=contract.shapes[:1], cfg=cfg)
        if not rec.summary.n_measured:
            raise SystemExit(f"a bench measured nothing: {rec.errors}")

    start = settled(target, op, str(tmpdir), None)
    t0 = time.monotonic()
    one()
    base = settled(target, op, str(tmpdir), start)
    for _ in range(args.n):
        one()
    after = settled(target, op, str(tmpdir), base)
    growth = {k: after[k] - base[k] for k in (*COUNTS, "workspace_bytes")}
    doc = {"n": args.n, "op": op, "repo": str(repo), "start": start, "base": base, "after": after,
           "growth": growth, "per_run_bytes": round(growth["workspace_bytes"] / max(1, args.n)),
           "seconds": round(time.monotonic() - t0, 1), "leaks": [k for k in COUNTS if growth[k] > 0]}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"{args.n + 1} benches of {op} in {doc['seconds']} s")
        print(f"{'':16}{'start':>10}{'base':>10}{'after':>10}{'growth':>10}")
        for k in (*COUNTS, "workspace_bytes"):
            print(f"{k:16}{start[k]:>10}{base[k]:>10}{after[k]:>10}{growth[k]:>+10}")
        print(f"workspace growth per bench: {doc['per_run_bytes']} bytes; "
              + ("no leak" if not doc["leaks"] else f"LEAKS: {', '.join(doc['leaks'])}"))
    shutil.rmtree(scratch, ignore_errors=True)  # the private TMPDIR (and the toy repo, if built here)
    return 1 if doc["leaks"] else 0


if __name__ == "__main__":
    sys.exit(main())
