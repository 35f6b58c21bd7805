"""The command line's habits: --version, -h, --debug anywhere, the JSON envelope on usage errors,
one spelling for list options, dtype aliases, --input checked before any worker, one word order
for sub-actions, tables that fit, Python 3.10, and the demo's example inside the wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.cli import flaloop
from support.repos import OP, ROOT


def run(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flaloop", *args], cwd=cwd or ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_version_and_short_help_everywhere():
    v = run("--version")
    assert v.returncode == 0 and v.stdout.startswith("flaloop ")
    for args in (["-h"], ["bench", "-h"], ["trap", "add", "-h"]):
        r = run(*args)
        assert r.returncode == 0 and "Usage: flaloop" in r.stdout, args


def test_debug_is_taken_anywhere_on_the_line(tmp_path):
    for args in (["--debug", "list"], ["list", "--debug"], ["list", "--json", "--debug"]):
        r = run(*args, "--repo", str(tmp_path))
        assert r.returncode == 2 and "Traceback" in r.stderr, args  # not a git repo: a usage error, traced


def test_a_mistyped_option_still_gets_its_json_envelope():
    r = run("init", OP, "--shape", "X", "--json")
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    assert doc == {"ok": False, "error": doc["error"], "hint": "`flaloop init --help` lists the options", "exit_code": 2}
    assert "--shape" in doc["error"] and "--shapes" in doc["error"]
    plain = run("init", OP, "--shape", "X")
    assert plain.returncode == 2 and plain.stdout == "" and "No such option" in plain.stderr


def test_a_list_option_and_a_typo_in_input_before_any_worker(repo):
    r = flaloop(repo, "init", OP, "--shapes", "B1_T64_H2_D32", "B2_T100_H2_D16", "--modes", "fwd", "fwdbwd",
                "--force", "--json")
    assert r.code == 0, r.stderr
    c = json.loads((repo / "profile" / f"{OP}-opt" / "contract.json").read_text())
    assert c["shapes"] == ["B1_T64_H2_D32", "B2_T100_H2_D16"] and c["modes"] == ["fwd", "fwdbwd"]
    runs = repo / "profile" / f"{OP}-opt" / "runs"
    before = sorted(runs.iterdir()) if runs.exists() else []
    r = flaloop(repo, "bench", OP, "--input", "z=l2norm", "--device", "cpu", "--json")
    assert r.code == 2 and "not inputs of" in r.json["error"] and "its inputs:" in r.json["hint"]
    r = flaloop(repo, "bench", OP, "--input", "k=l2nrom", "--device", "cpu", "--json")
    assert r.code == 2 and "unknown transform" in r.json["error"] and "l2norm" in r.json["hint"]
    assert (sorted(runs.iterdir()) if runs.exists() else []) == before  # nothing started, nothing recorded
    # piped (CI, an agent): no progress bar, but plain progress lines on stderr, with the time so far
    r = flaloop(repo, "bench", OP, "--shapes", "B1_T64_H2_D32", "--modes", "fwd", "--device", "cpu", "--min-pairs", "6",
                "--max-pairs", "6", "--rounds", "1", "--cell-seconds", "5", "--json")
    assert r.code == 0 and r.json["cells"][0]["cell"]["id"] == "B1_T64_H2_D32/fwd", r.stdout[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("[") and "s] bench: " in line]
    assert [line.split("] ", 1)[1] for line in lines][:2] == ["bench: starting workers",
                                                             "bench: warm-up, correctness, probes"]


def _python310() -> str | None:
    """A Python 3.10 that runs (pyenv's shim may name one that is not selected)."""
    found = [shutil.which("python3.10"), *sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))]
    for exe in filter(None, found):
        if subprocess.run([exe, "-c", "import sys; assert sys.version_info[:2] == (3, 10)"],
                          capture_output=True).returncode == 0:
            return exe
    return None


PY310 = _python310()


@pytest.mark.skipif(PY310 is None, reason="no Python 3.10 here")
def test_the_package_compiles_under_python_3_10():
    """The syntax of every module under 3.10 (pyproject says >=3.10; tomllib falls back to tomli). The
    whole CLI and a bench on 3.10 were tried by hand (docs/BENCHMARKS.md): its dependencies are not here."""
    r = subprocess.run([PY310, "-m", "compileall", "-q", str(ROOT / "flaloop")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_wheel_carries_the_example_and_the_skill(tmp_path):
    """`flaloop demo` and `flaloop skill install` after a plain pip install: both files ship inside."""
    pytest.importorskip("setuptools")  # the build runs here, without isolation: no download
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), "-q"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    wheel = next(tmp_path.glob("flaloop-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "flaloop/SKILL.md" in names
    assert "flaloop/_example/minifla/benchmarks/ops/registry.py" in names
    assert "flaloop/_example/minifla/minifla/ops/linear_attn/chunk.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = subprocess.run([sys.executable, "-c", "import flaloop.loop.demo as d; print(d.EXAMPLE)"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()) == site / "flaloop" / "_example" / "minifla"


def test_a_mistyped_command_is_hinted_at_the_command_list():
    r = run("bnech", OP, "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["hint"] == "`flaloop --help` lists the commands"


