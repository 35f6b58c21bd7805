"""benchmarks/run.py, the one entry point of flaloop's GPU benchmarks, can be read and driven here:
every plan names suites that exist, and `wait` on a run that never started says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "run.py"


def test_every_plan_names_suites_that_exist():
    out = subprocess.run([sys.executable, "-c", "import run\n"
                          "missing = [n for plan in run.PLANS.values() for phase in plan for lane in phase\n"
                          "           for n in lane if n not in run.SUITES]\n"
                          "print(sorted(run.SUITES), missing)"],
                         cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[]"), out.stdout
    assert "'verify'" in out.stdout and "'slowdown'" in out.stdout


def test_help_and_wait_on_a_run_that_never_started(tmp_path):
    h = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert h.returncode == 0 and "verify" in h.stdout and "h200" in h.stdout
    w = subprocess.run([sys.executable, str(SCRIPT), "wait", "0", "--work", str(tmp_path / "work"),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert w.returncode == 0 and "no log" in w.stdout and "STILL RUNNING" in w.stdout


def test_the_tilelang_lowering_check_without_tilelang_says_what_to_put_on_the_path():
    """benchmarks/tilelang_lowering.py needs tilelang and FLA importable (neither is on CI): it says
    so and exits 2, before lowering anything."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tilelang_lowering.py")], capture_output=True,
                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ""})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot import tilelang and FLA's TileLang kernels" in r.stderr and "PYTHONPATH" in r.stderr
