"""`flaloop compare A B`: two stored run records side by side (flaloop/report/compare.py), nothing re-measured.

Exit codes: 0 compared; 1 with --fail-on slower, B is SLOWER than A on a cell or the geomean;
2 a record was not found or cannot be read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flaloop.cli.app import FailOnOpt, JsonOpt, RepoOpt, app, command, emit_json, fail_on_exit, human, out
from flaloop.core import git
from flaloop.core.errors import FlaloopError
from flaloop.report import compare


@app.command("compare")
@command
def compare_cmd(
    a: Annotated[str, typer.Argument(help="The reference: a record.json, a run directory, or a run id "
                                          "under profile/<op>-opt/runs/.")],
    b: Annotated[str, typer.Argument(help="The record compared with A (the same forms).")],
    op: Annotated[str | None, typer.Option("--op", help="Look run ids up under this op's runs only.")] = None,
    fail_on: FailOnOpt = None,
    repo: RepoOpt = None, as_json: JsonOpt = False,
) -> None:
    """B against A per cell: both speedups, B's change relative to A with an interval where both were
    measured against the same base, and what cannot be compared and why."""
    try:
        root = git.repo_root(Path(repo) if repo else Path.cwd())
    except FlaloopError:
        root = None  # record paths need no repository
    ra, rb = compare.resolve(a, root, op), compare.resolve(b, root, op)
    cmp = compare.compare(ra, rb)
    console = human(as_json)
    code = fail_on_exit(0, fail_on, cmp.slower, console)
    if as_json:
        emit_json({"ok": True, "kind": "compare", **cmp.to_dict(), "exit_code": code})
    else:
        out.print(compare.render_markdown(cmp))
    raise typer.Exit(code)
