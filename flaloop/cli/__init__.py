"""Command line: one thin function per command; parsing and printing only.

`app.py` holds the typer app, the consoles, exit-code mapping and option groups; each other
module registers the commands of one area on that app. Which module that is, is
`COMMAND_MODULES`: `main()` imports only the module of the command a line names, since the other
modules' imports are most of a short command's start (docs/lab/2026-12-04-cpu.md R31). A line that
names no known command (`--help`, a typo, nothing) loads them all, so that the listing and click's
suggestions see every command; so does anything that reads the whole app (`load_commands()`: the
MCP server's tools, the docs' checks).
"""

from __future__ import annotations

import importlib
import sys

import typer
import typer.main

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

# The module (under flaloop/cli/) that registers each command; tests/unit/test_cli_conventions.py
# holds it to what the modules register.
COMMAND_MODULES = {
    "list": "setup", "init": "setup", "audit": "guard",
    "gate": "measure", "bench": "measure", "verify": "measure", "sanitize": "measure",
    "baseline": "loop", "iter": "loop", "status": "loop", "log": "loop", "header": "loop", "trap": "loop",
    "reassess": "loop", "dispatch": "loop", "stop": "loop",
    "report": "report", "profile": "report", "explain": "report",
    "compare": "compare", "sweep": "sweep", "model": "model", "clean": "maint",
    "skill": "agent", "mcp": "agent", "demo": "demo",
}


def load_commands(name: str | None = None) -> None:
    """Register command `name` on the app, or every command (None, or a name no module registers)."""
    mod = COMMAND_MODULES.get(name) if name else None
    for m in [mod] if mod else sorted(set(COMMAND_MODULES.values())):
        importlib.import_module(f"flaloop.cli.{m}")


def main(argv: list[str] | None = None) -> None:
    # Ctrl-C and SIGTERM unwind the same way, so worktrees and workers are always cleaned up; a
    # second or third one while that cleanup runs only says "please wait" (see flaloop.core.procs).
    procs.install_signal_handlers()
    args = list(sys.argv[1:] if argv is None else argv)
    head = args[: args.index("--")] if "--" in args else args
    if "--debug" in head:  # a global option, taken wherever it stands
        settings.debug = True
        args = [a for i, a in enumerate(args) if not (a == "--debug" and i < len(head))]
    # the root's options are flags, so its first other word is the command
    load_commands(next((a for a in args if not a.startswith("-")), None))
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
