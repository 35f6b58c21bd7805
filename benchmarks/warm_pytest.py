"""What one run of an op's test file costs in a fresh interpreter, against one forked from an
interpreter that imported torch, triton and pytest once.

The suite's CPU goes mostly to the gate's pytest processes (docs/lab/2026-12-03-cpu.md, R24), and a
fresh one pays the imports every time; this measures what a warm start leaves of each run, the
test file alone. The gate now forks its pytest from the bench's warm fork server where it can
(flaloop/task/pytest_run.py, `warm_server`); benchmarks/gate_forked.py times the gate itself so. Each run is a plain `pytest -q <test file>` (no gate plugin: its cost is
benchmarks/gate_integrity_cost.py's question), cold and warm alternating, CPU from RUSAGE_CHILDREN.

On the CPU, a copy of examples/minifla under the Triton interpreter:

    TRITON_INTERPRET=1 python benchmarks/warm_pytest.py --rounds 3

Another tree and test file (FLA's, say): `--repo .fla --test tests/ops/test_gla.py`.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _cold(repo: Path, args: list[str]) -> tuple[float, float, int]:
    c0, t0 = _children_cpu(), time.perf_counter()
    code = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=repo, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode
    return _children_cpu() - c0, time.perf_counter() - t0, code


def _warm(repo: Path, args: list[str]) -> tuple[float, float, int]:
    import pytest

    c0, t0 = _children_cpu(), time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: the tree's directory and path, output dropped, pytest's exit code
        try:
            os.chdir(repo)
            sys.path.insert(0, str(repo))
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            code = int(pytest.main(args))
        except BaseException:  # noqa: BLE001 - a child must never return into the parent's code
            code = 99
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return _children_cpu() - c0, time.perf_counter() - t0, os.waitstatus_to_exitcode(status)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=None, help="the tree (default: a copy of examples/minifla)")
    ap.add_argument("--test", default="tests/ops/test_linear_attn.py", help="the test file, relative to --repo")
    ap.add_argument("--rounds", type=int, default=3, help="cold and warm runs each, alternating")
    a = ap.parse_args()
    tmp = None
    repo = a.repo
    if repo is None:
        tmp = Path(tempfile.mkdtemp(prefix="flaloop-warm-pytest-"))
        repo = tmp / "minifla"
        shutil.copytree(ROOT / "examples" / "minifla", repo)
    try:
        args = ["-q", "-p", "no:cacheprovider", a.test]
        if not (repo / a.test).is_file():
            print(f"no test file {repo / a.test}: name one with --test", file=sys.stderr)
            return 2
        c0 = time.process_time()
        import pytest  # noqa: F401
        import torch  # noqa: F401
        import triton  # noqa: F401
        preload = time.process_time() - c0
        cold, warm = [], []
        for _ in range(a.rounds):
            cold.append(_cold(repo, args))
            warm.append(_warm(repo, args))
        bad = [code for _, _, code in cold + warm if code != 0]
        if bad:
            print(f"a run of the test file failed (exit {bad[0]}): the figures would not be comparable", file=sys.stderr)
            return 1
        med = {name: (statistics.median(c for c, _, _ in runs), statistics.median(w for _, w, _ in runs))
               for name, runs in (("cold", cold), ("warm", warm))}
        print(f"the warm interpreter's imports (torch, triton, pytest), once: {preload:.2f} s CPU")
        for name, runs in (("cold", cold), ("warm", warm)):
            print(f"{name}: median {med[name][0]:.2f} s CPU, {med[name][1]:.2f} s wall per run "
                  f"({', '.join(f'{c:.2f}/{w:.2f}' for c, w, _ in runs)})")
        print(f"warm / cold CPU per run: {med['warm'][0] / med['cold'][0]:.3f}")
        return 0
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
