"""The docs cannot drift from the CLI: every `flaloop ...` command in a fenced code block of
SKILL.md, README.md and docs/COMMANDS.md is a real command, and every option it names is in that command's help.

A command split over lines with a trailing backslash counts as one line, as in a shell.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from support.repos import ROOT
from typer.main import get_command
from typer.testing import CliRunner

from flaloop.cli import app, load_commands

load_commands()  # every command on the app, as `flaloop --help` sees it

DOCS = ("SKILL.md", "README.md", "docs/COMMANDS.md")
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


def parse(args: list[str]):
    """Parse a command line as `flaloop` would, down to its (sub)command, with its values checked
    (types, choices, counts); nothing runs."""
    from flaloop.cli.app import normalize_argv

    root = get_command(app)
    argv = normalize_argv(list(args), root)
    cmd, ctx, i = root, root.make_context("flaloop", [], resilient_parsing=True), 0
    while hasattr(cmd, "commands") and i < len(argv) and argv[i] in cmd.commands:
        cmd, i = cmd.commands[argv[i]], i + 1
        if hasattr(cmd, "commands"):
            ctx = cmd.make_context(cmd.name, [], parent=ctx, resilient_parsing=True)
    assert not hasattr(cmd, "commands"), f"{shlex.join(args)} names no command"
    return cmd, cmd.make_context(cmd.name, argv[i:], parent=ctx)


@pytest.mark.parametrize(("doc", "line", "args"), CASES, ids=[f"{d}:{n}" for d, n, _ in CASES])
def test_every_documented_command_line_parses_with_its_values(doc, line, args):
    try:
        parse(args)
    except Exception as exc:  # noqa: BLE001 - the message is the point
        pytest.fail(f"{doc}:{line}: `flaloop {shlex.join(args)}` does not parse: {exc}")


def test_the_parser_check_catches_a_bad_value_and_a_stray_word():
    with pytest.raises(Exception, match="valid integer"):
        parse(["bench", "op", "--min-pairs", "many"])
    with pytest.raises(Exception, match="unexpected extra argument|Got unexpected"):
        parse(["status", "op", "stray"])


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """The heading anchors GitHub makes for a markdown file."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            out.add(slug.replace(" ", "-"))
    return out


def doc_links(names=("README.md", "docs/COMMANDS.md")) -> list[tuple[str, str]]:
    out = []
    for name in names:
        for target in LINK.findall((ROOT / name).read_text()):
            if not re.match(r"[a-z]+:", target):
                out.append((name, target))
    return out


def test_the_readme_and_its_pages_link_to_files_and_headings_that_exist():
    links = doc_links()
    assert any(t.startswith("docs/COMMANDS.md#") for _, t in links)
    for name, target in links:
        path, _, anchor = target.partition("#")
        dest = (ROOT / name).parent / path if path else ROOT / name
        assert dest.exists(), f"{name}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{name}: link to {target}: no such heading"


def test_the_link_check_catches_a_missing_heading(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("## `flaloop gate OP [-k EXPR]`\n")
    assert "flaloop-gate-op--k-expr" in _anchors(page)
    assert "flaloop-gate-op" not in _anchors(page)
