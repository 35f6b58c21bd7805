"""Command line: one thin function per command; parsing and printing only.

`app.py` holds the typer app, the consoles, exit-code mapping and option groups; each other
module registers the commands of one area on that app.
"""

from __future__ import annotations

import signal
import sys

from flaloop.cli import demo, guard, loop, measure, report, setup  # noqa: F401  (register their commands)
from flaloop.cli.app import app


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # Ctrl-C and SIGTERM unwind the same way, so worktrees and workers are always cleaned up.
    # SIGINT is re-armed explicitly: a parent that ignores it (a background job of a script, an
    # xdist worker) would otherwise leave us deaf to the interrupt it forwards.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)
    app(prog_name="flaloop")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
