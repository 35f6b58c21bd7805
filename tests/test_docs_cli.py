"""The docs cannot drift from the CLI: every `flaloop ...` command in a fenced code block of
SKILL.md and README.md is a real command, and every option it names is in that command's help.

A command split over lines with a trailing backslash counts as one line, as in a shell.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from flaloop.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("SKILL.md", "README.md")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def doc_commands() -> list[tuple[str, int, list[str]]]:
    out = []
    for name in DOCS:
        text = (ROOT / name).read_text()
        for m in FENCE.finditer(text):
            first = text[: m.start(1)].count("\n") + 1
            lines, pending, start = m.group(1).splitlines(), "", 0
            for i, line in enumerate(lines):
                if not pending:
                    start = i
                line = line.strip()
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                    continue
                line, pending = (pending + line).removeprefix("$ "), ""
                if line.startswith("flaloop "):
                    out.append((name, first + start, shlex.split(line, comments=True)[1:]))
    return out


CASES = doc_commands()


def test_the_docs_show_commands():
    names = {args[0] for _, _, args in CASES if args}
    assert {"init", "gate", "verify", "profile", "report"} <= names
    assert len([c for c in CASES if c[0] == "SKILL.md"]) >= 15


def _help(cmd: str) -> str | None:
    group = get_command(app)
    if cmd not in group.commands:  # type: ignore[attr-defined]
        return None
    r = CliRunner().invoke(app, [cmd, "--help"], prog_name="flaloop")
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize(("doc", "line", "args"), CASES, ids=[f"{d}:{n}" for d, n, _ in CASES])
def test_every_documented_command_and_option_exists(doc, line, args):
    cmd = args[0]
    text = _help(cmd)
    if text is None:
        pytest.fail(f"{doc}:{line}: `flaloop {cmd}` is not a command")
    for tok in args[1:]:
        if tok.startswith("-") and not re.fullmatch(r"-?\d+(\.\d+)?x?", tok):
            opt = tok.split("=", 1)[0]
            assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text), \
                f"{doc}:{line}: `flaloop {cmd}` has no option {opt}"


def test_a_made_up_option_is_caught():
    text = _help("gate")
    assert re.search(r"(?<![\w-])--workers(?![\w-])", text)
    assert not re.search(r"(?<![\w-])--work(?![\w-])", text)
