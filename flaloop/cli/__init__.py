"""Command line: one thin function per command; parsing and printing only.

`app.py` holds the typer app, the consoles, exit-code mapping and option groups; each other
module registers the commands of one area on that app.
"""

from __future__ import annotations

import sys

import typer
import typer.main

from flaloop.cli import agent, compare, demo, guard, loop, maint, measure, model, report, setup, sweep  # noqa: F401  (register their commands)
from flaloop.cli.app import (
    ClickException,
    NoArgsIsHelpError,
    UsageError,
    app,
    emit_json,
    normalize_argv,
    settings,
)
from flaloop.cli.help import polish
from flaloop.core import procs


def main(argv: list[str] | None = None) -> None:
    # Ctrl-C and SIGTERM unwind the same way, so worktrees and workers are always cleaned up; a
    # second or third one while that cleanup runs only says "please wait" (see flaloop.core.procs).
    procs.install_signal_handlers()
    args = list(sys.argv[1:] if argv is None else argv)
    head = args[: args.index("--")] if "--" in args else args
    if "--debug" in head:  # a global option, taken wherever it stands
        settings.debug = True
        args = [a for i, a in enumerate(args) if not (a == "--debug" and i < len(head))]
    root = typer.main.get_command(app)
    polish(root)
    args = normalize_argv(args, root)
    try:
        code = root.main(args=args, prog_name="flaloop", standalone_mode=False)
    except NoArgsIsHelpError as exc:  # `flaloop` alone: its help, and the usage-error exit code
        exc.show()
        sys.exit(2)
    except UsageError as exc:  # a mistyped option or value: exit 2, and the envelope for agents
        if "--json" in head:
            cmd = exc.ctx.command_path if exc.ctx else "flaloop"
            what = "commands" if exc.ctx is None or getattr(exc.ctx.command, "commands", None) else "options"
            emit_json({"ok": False, "error": exc.format_message(), "hint": f"`{cmd} --help` lists the {what}",
                       "exit_code": 2})
        exc.show()
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    except ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
