"""The command line's habits: --version, -h, --debug anywhere, the JSON envelope on usage errors,
one spelling for list options, dtype aliases, --input checked before any worker, one word order
for sub-actions, tables that fit, Python 3.10, and the demo's example inside the wheel."""

from __future__ import annotations

import json
import sys

import pytest
from rich.console import Console
from rich.table import Table
from support.repos import OP
from typer.main import get_command

from flaloop.bench.model import BenchConfig
from flaloop.cli import app, load_commands
from flaloop.cli.app import normalize_argv
from flaloop.report.terminal import print_table

load_commands()  # every command on the app, as `flaloop --help` sees it


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


def test_each_command_is_loaded_from_the_module_that_registers_it():
    from flaloop.cli import COMMAND_MODULES
    from flaloop.cli.app import COMMAND_ORDER

    registered = {ci.name or ci.callback.__name__: ci.callback.__module__ for ci in app.registered_commands}
    assert registered == {name: f"flaloop.cli.{m}" for name, m in COMMAND_MODULES.items()}
    assert set(COMMAND_ORDER) == set(COMMAND_MODULES)


LOADED = """
import sys
from flaloop.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(" ".join(sorted(m for m in sys.modules if m.startswith("flaloop.cli."))), file=sys.__stderr__)
"""


@pytest.mark.parametrize("argv, loaded, not_loaded", [
    (["status", "--help"], {"loop", "measure"}, {"sweep", "agent", "setup", "model"}),
    (["--debug", "list", "--help"], {"setup"}, {"loop", "measure", "sweep", "agent"}),
    (["--help"], {"loop", "measure", "sweep", "agent", "setup", "model", "maint", "demo"}, set()),
    (["bnch"], {"loop", "measure", "sweep", "agent"}, set()),  # a typo: click suggests from every command
])
def test_a_command_line_imports_only_the_module_of_its_command(argv, loaded, not_loaded):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", LOADED, *argv], capture_output=True, text=True, timeout=60)
    mods = {m.removeprefix("flaloop.cli.") for m in r.stderr.strip().splitlines()[-1].split()}
    assert loaded <= mods and not (not_loaded & mods), (mods, r.stderr[-2000:])
