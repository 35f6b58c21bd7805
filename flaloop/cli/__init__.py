"""Command line: one thin function per command; parsing and printing only.

`app.py` holds the typer app, the consoles, exit-code mapping and option groups; each other
module registers the commands of one area on that app.
"""

from __future__ import annotations

import sys

from flaloop import procs
from flaloop.cli import demo, guard, loop, maint, measure, report, setup, sweep  # noqa: F401  (register their commands)
from flaloop.cli.app import app


def main() -> None:
    # Ctrl-C and SIGTERM unwind the same way, so worktrees and workers are always cleaned up; a
    # second or third one while that cleanup runs only says "please wait" (see flaloop.procs).
    procs.install_signal_handlers()
    app(prog_name="flaloop")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
