"""benchmarks/run.py, the one entry point of flaloop's GPU benchmarks, can be read and driven here:
every plan names suites that exist, and `wait` on a run that never started says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

from support.repos import ROOT

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


def test_a_foreground_run_on_the_device_packs_its_results_into_out(tmp_path):
    """The device gives back 8 files of $OUT, 2 folders down: a foreground run whose --out is $OUT
    writes under --work and leaves $OUT holding results.tgz and goals.txt alone, every file inside."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(SCRIPT), "machine", "--gpus", "0", "--work", str(tmp_path / "work"),
                        "--deadline", "60"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OUT": str(out)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["goals.txt", "results.tgz"]
    with tarfile.open(out / "results.tgz") as tar:
        names = tar.getnames()
    assert "out/goals.txt" in names and any(n.startswith("out/machine/") for n in names), names


def test_wait_follows_the_newest_background_run_not_an_earlier_one_on_the_same_machine(tmp_path):
    """A warm device machine keeps --work between calls: a second detached run sets the first's results
    aside, so `wait` neither reads the first's goals as the second's end nor loses them."""
    work, out = tmp_path / "work", tmp_path / "out"
    env = {**os.environ, "OUT": ""}
    for n in (1, 2):
        r = subprocess.run([sys.executable, str(SCRIPT), "machine", "--gpus", "0", "--work", str(work),
                            "--deadline", "60", "--background"], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0 and "started in the background" in r.stdout, r.stdout + r.stderr
        if n == 1:
            w = subprocess.run([sys.executable, str(SCRIPT), "wait", "100", "--work", str(work), "--out", str(out)],
                               capture_output=True, text=True, timeout=120)
            assert "ALL DONE" in w.stdout, w.stdout
    kept = [d for d in work.iterdir() if d.name.startswith("out-")]
    assert len(kept) == 1 and (kept[0] / "goals.txt").exists()  # the first run's results, whole
    w = subprocess.run([sys.executable, str(SCRIPT), "wait", "100", "--work", str(work), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert "ALL DONE" in w.stdout and (work / "out" / "goals.txt").exists(), w.stdout


def test_a_backend_goal_reads_the_backend_from_the_dispatch_record():
    """FLA's dispatch record names `op -> backend`: every call on the backend, none, or another's."""
    r = subprocess.run([sys.executable, "-c", "from suites_backends import _by\n"
                        "print(_by('gluon', ['fused_attnres -> gluon']), _by('gluon', []),\n"
                        "      _by('tilelang', ['parallel_attn_fwd -> tilelang', 'parallel_attn_bwd -> triton']),\n"
                        "      _by('gluon', ['fused_attnres -> gluon_v2']))"],
                       cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False", "False", "False"]


def test_the_suite_log_plugin_writes_each_test_and_the_summary_reads_it(tmp_path):
    """benchmarks/suite_log.py as a pytest plugin over a tiny suite of its own, then as the summary."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_a.py").write_text("import time\n\ndef test_slow():\n    time.sleep(0.3)\n\ndef test_fast():\n    pass\n")
    (suite / "test_b.py").write_text("def test_one():\n    pass\n")
    logs = tmp_path / "log"
    env = {**os.environ, "SUITE_LOG_DIR": str(logs), "PYTHONPATH": str(ROOT / "benchmarks")}
    env.pop("PYTEST_XDIST_WORKER", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_log", "-p", "no:cacheprovider", str(suite)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p.name for p in logs.iterdir()] == ["main.jsonl"] and len((logs / "main.jsonl").read_text().splitlines()) == 6
    s = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_log.py"), str(logs), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert s.returncode == 0, s.stderr
    doc = json.loads(s.stdout)
    assert doc["tests"][0][0].endswith("test_a.py::test_slow") and doc["tests"][0][1] >= 0.3
    assert doc["modules"][0][0].endswith("test_a.py") and doc["end_gap_s"] == 0.0
    missing = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_log.py"), str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "-p suite_log" in missing.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "gw0.jsonl").write_text("")
    empty = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_log.py"), str(tmp_path / "empty")],
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "hold no test" in empty.stderr
