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
from conftest import OP, flaloop
from rich.console import Console
from rich.table import Table
from typer.main import get_command

from flaloop.bench.model import BenchConfig
from flaloop.cli import app
from flaloop.cli.app import normalize_argv
from flaloop.report.terminal import print_table

ROOT = Path(__file__).resolve().parents[1]


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


@pytest.mark.parametrize("spelled", [
    ["--shapes", "A", "B", "--modes", "fwd", "fwdbwd"],
    ["--shapes", "A,B", "--modes", "fwd,fwdbwd"],
    ["--shapes", "A", "--shapes", "B", "--modes", "fwd", "--modes", "fwdbwd"],
    ["--shapes=A", "B", "--modes=fwd,fwdbwd"],
])
def test_every_list_option_takes_every_spelling(spelled):
    root = get_command(app)
    got = normalize_argv(["bench", OP, *spelled, "--json"], root)
    assert got == ["bench", OP, "--shapes", "A", "--shapes", "B", "--modes", "fwd,fwdbwd", "--json"]


def test_list_values_stop_at_a_word_with_spaces_and_keep_assignments_whole():
    root = get_command(app)
    got = normalize_argv(["iter", OP, "--shapes", "A", "B", "the direction, with spaces"], root)
    assert got == ["iter", OP, "--shapes", "A", "--shapes", "B", "the direction, with spaces"]
    got = normalize_argv(["bench", OP, "--input", "k=l2norm", "q=l2norm", "--", "--shapes", "x"], root)
    assert got == ["bench", OP, "--input", "k=l2norm", "--input", "q=l2norm", "--", "--shapes", "x"]
    got = normalize_argv(["sanitize", OP, "--tool", "memcheck", "racecheck,initcheck"], root)
    assert got == ["sanitize", OP, "--tool", "memcheck", "--tool", "racecheck", "--tool", "initcheck"]


def test_the_dtype_names_the_test_ids_use():
    for alias, name in (("fp16", "float16"), ("bf16", "bfloat16"), ("fp32", "float32"), ("float16", "float16")):
        assert BenchConfig(dtype=alias).check().dtype == name
    with pytest.raises(Exception, match="--dtype int8: not one of"):
        BenchConfig(dtype="int8").check()


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


def _bench_like_table() -> Table:
    t = Table(title="t")
    for col in ("shape", "mode", "timer", "base", "cand", "speedup", "95% CI", "verdict", "pairs", "eager base",
                "eager cand", "% floor", "note"):
        t.add_column(col, no_wrap=col != "note", overflow="fold", min_width=14 if col == "note" else None)
    for i in range(3):
        t.add_row(f"B8_T2048_H32_D256_{i}", "fwdbwd", "cuda_graph", "12.3456", "11.2345", "1.0989x",
                  "[1.0912, 1.1067]", "FASTER", "40/40", "12.9012", "11.8012", "71%", "launch-bound (host > device)")
    return t


def test_a_table_fits_a_100_column_terminal_by_dropping_what_matters_least(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    console = Console(highlight=False, soft_wrap=True, markup=False, file=sys.stdout)
    hidden = print_table(console, _bench_like_table(), drop=("eager base", "eager cand", "timer", "% floor", "pairs",
                                                             "note"))
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if "│" in line or "━" in line]
    assert max(len(line) for line in rows) <= 100
    assert "B8_T2048_H32_D256_0" in text and "[1.0912, 1.1067]" in text and "1.0989x" in text  # whole, never cut
    assert "hidden to fit 100 columns" in text and hidden == ["eager base", "eager cand", "timer", "% floor", "pairs",
                                                              "note"]


def test_a_table_in_a_file_keeps_its_full_width(monkeypatch, tmp_path):
    monkeypatch.delenv("COLUMNS", raising=False)
    path = tmp_path / "out.txt"
    with path.open("w") as f:
        print_table(Console(file=f, width=100, highlight=False, markup=False), _bench_like_table(), drop=("timer",))
    text = path.read_text()
    assert "hidden" not in text and "eager cand" in text and "launch-bound (host > device)" in text
    assert max(len(line) for line in text.splitlines()) > 100


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


def _help(name: str | None = None) -> str:
    """A command's --help as the CLI prints it (the polished command tree `cli.main` builds), in-process."""
    from flaloop.cli.help import polish

    root = get_command(app)
    polish(root)
    ctx = root.context_class(root, info_name="flaloop", terminal_width=100)
    if name is None:
        return root.get_help(ctx)
    cmd = root.commands[name]
    return cmd.get_help(cmd.context_class(cmd, info_name=name, parent=ctx, terminal_width=100))


def test_help_reads_like_git_and_pytest():
    import re

    root = _help()
    heads = [root.index(h) for h in ("Set up:", "The loop:", "Measure and look closer:", "Housekeeping and agents:")]
    assert heads == sorted(heads)
    listed = re.findall(r"^  (\w+) ", root.split("Set up:")[1], re.M)
    assert listed[:6] == ["list", "init", "gate", "audit", "baseline", "iter"] and listed[-1] == "demo"
    for name in get_command(app).commands:
        text = _help(name)
        assert "Examples:\n" in text and f"flaloop {name}" in text.split("Examples:")[1], name
        # metavars in capitals, never typer's Python types
        assert not re.search(r"<(str|int|float|list\[\w+\]|path)>|\{[a-z_]+\}", text), (name, text)
        assert "Common options:" in text and text.index("Common options:") > text.find("\nOptions:"), name
    bench = _help("bench")
    assert "Usage: flaloop bench [OPTIONS] OP\n" in bench and "--min-pairs N " in bench and "--margin X " in bench
    assert bench.index("--aa") < bench.index("Measurement options:") < bench.index("--min-pairs")
    gate = _help("gate")
    assert "--workers N " in gate and "[default: 0]" not in gate  # its text says what the default is
    assert "-k EXPR" in gate


def test_a_mistyped_command_is_hinted_at_the_command_list():
    r = run("bnech", OP, "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["hint"] == "`flaloop --help` lists the commands"


def test_an_interrupted_command_answers_with_a_hint_in_json(capsys):
    import typer

    from flaloop.cli.app import command

    @command
    def cut_short(as_json: bool = False) -> None:
        exc = KeyboardInterrupt()
        exc.record_path = "/w/runs/x/record.json"
        raise exc

    with pytest.raises(typer.Exit) as exit_:
        cut_short(as_json=True)
    assert exit_.value.exit_code == 130
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"] == "interrupted" and doc["record"] == "/w/runs/x/record.json"
    assert "run the command again" in doc["hint"] and doc["record"] in doc["hint"]


def test_sweep_progress_never_prints_none():
    from types import SimpleNamespace

    from flaloop.cli.sweep import _events

    said = []

    class Bar:
        def add_task(self, description, **kw):
            said.append(description)
            return 0

        def update(self, task, description=None, **kw):
            said.append(description)

    on_event = _events(Bar(), {"k": SimpleNamespace(ref="opt/c128", kind="candidate", op=OP)})
    on_event("start", key="k", where=None)
    on_event("retry", key="k", why=None)
    on_event("done", key="k", status=None, verdict=None)
    on_event("done", key="k", status="ok", verdict="FASTER")
    assert said == ["opt/c128: queued", "opt/c128: started", "opt/c128: retried ()", "opt/c128: done",
                    "opt/c128: ok FASTER"]
