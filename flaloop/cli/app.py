"""The typer app, the two consoles, the error-to-exit-code wrapper and the options every command shares.

Exit codes: 0 verdict delivered / gate green, 1 gate red or guard blocked, 2 usage or setup error,
3 measurement failed, 4 internal error (a bug in flaloop), 130 interrupted. Every command takes
--json for agents: then stdout carries exactly one JSON document and human output goes to stderr.

Options shared by several commands are declared once, as an `OptionGroup` (a dataclass whose
fields carry their typer annotations); `with_options(Group)` adds the group's options to a
command's signature and hands the command one instance of the group.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import sys
from collections.abc import Callable
from typing import Annotated, Any, get_type_hints

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flaloop.errors import FlaloopError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Make GPU kernels faster without breaking or gaming correctness.")
# Not a terminal (CI, agents, pipes): rich would assume 80 columns and truncate paths.
# markup is off by default: test ids, diffs and messages are full of [brackets]. Literal styled
# strings opt in with markup=True and escape() whatever they interpolate.
out = Console(highlight=False, soft_wrap=True, markup=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False,
              width=None if sys.stderr.isatty() else 200)

RepoOpt = Annotated[str | None, typer.Option("--repo", help="Target checkout (default: the git root of the cwd).")]
PyOpt = Annotated[str | None, typer.Option("--python", help="Target's interpreter (default: this one).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document on stdout, for agents.")]

INTERNAL_ERROR = 4


def emit_json(doc: dict) -> None:
    """The one JSON document of a --json run."""
    print(json.dumps(doc, default=str))


def command(fn: Callable) -> Callable:
    """Map FlaloopError to its exit code and message; survive Ctrl-C with exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return fn(*args, **kwargs)
        except FlaloopError as exc:
            if as_json:
                emit_json({"ok": False, "error": exc.message, "hint": exc.hint, "exit_code": exc.exit_code})
            err.print(f"[bold red]error:[/] {escape(exc.message)}", markup=True)
            if exc.hint:
                err.print(f"  hint: {exc.hint}")
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt as exc:
            record = getattr(exc, "record_path", None)
            if as_json:
                emit_json({"ok": False, "error": "interrupted", "exit_code": 130, "record": record})
            err.print("interrupted: temporary worktrees and processes were cleaned up"
                      + (f"; the run record so far: {record}" if record else ""))
            raise typer.Exit(130) from None

    return wrapper


def human(as_json: bool) -> Console:
    """Where human-readable output goes: stderr when stdout is reserved for JSON."""
    return err if as_json else out


def progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[last]}"), console=console, transient=True)


# -- option groups ------------------------------------------------------------------------------

def with_options(*groups: type) -> Callable[[Callable], Callable]:
    """Add every field of each option-group dataclass to the command's options.

    The decorated function takes one parameter per group, named after the group in snake case
    (`BenchOptions` -> `bench_options`), and receives an instance built from the parsed options.
    """

    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        hints = get_type_hints(fn, include_extras=True)
        slots = {_slot(g): g for g in groups}
        missing = [s for s in slots if s not in sig.parameters]
        if missing:
            raise TypeError(f"{fn.__name__} lacks parameter(s) {missing} for its option groups")
        params = [p.replace(annotation=hints.get(p.name, p.annotation))
                  for p in sig.parameters.values() if p.name not in slots]
        fields: dict[str, list[str]] = {}
        taken = {p.name for p in params}
        annotations = {p.name: p.annotation for p in params}
        for slot, group in slots.items():
            ghints = get_type_hints(group, include_extras=True)
            fields[slot] = []
            for f in dataclasses.fields(group):
                if f.name in taken:
                    raise TypeError(f"option {f.name!r} of {group.__name__} clashes in {fn.__name__}")
                taken.add(f.name)
                fields[slot].append(f.name)
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                                annotation=ghints[f.name]))
                annotations[f.name] = ghints[f.name]
        # keyword-only parameters must follow positional ones; keep the command's own order first
        params.sort(key=lambda p: p.kind)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any):
            for slot, group in slots.items():
                kwargs[slot] = group(**{name: kwargs.pop(name) for name in fields[slot]})
            return fn(*args, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=params, return_annotation=sig.return_annotation)  # type: ignore[attr-defined]
        wrapper.__annotations__ = annotations
        del wrapper.__wrapped__  # typer must see the new signature, not the function's own
        return wrapper

    return decorate


def _slot(group: type) -> str:
    name = group.__name__
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))
