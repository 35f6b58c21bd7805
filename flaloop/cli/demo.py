"""`flaloop demo`: the loop on the bundled example."""

from __future__ import annotations

from typing import Annotated

import typer

from flaloop.cli.app import app, command, out


@app.command("demo")
@command
def demo_cmd(
    keep: Annotated[str | None, typer.Option(
        "--dir", "--keep", help="Make the scratch repo under this directory (default: a new temp dir); it is kept "
                                "either way, and its path printed.")] = None,
) -> None:
    """Run the whole loop on the bundled example (examples/minifla) in a scratch git repo."""
    from pathlib import Path

    from flaloop.loop.demo import run_demo

    run_demo(out, Path(keep).resolve() if keep else None)
