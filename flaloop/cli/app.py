"""The typer app, the two consoles, the error-to-exit-code wrapper and the options every command shares.

Exit codes: 0 verdict delivered / gate green, 1 gate red or guard blocked, 2 usage or setup error
(also: a file flaloop must write cannot be written, the workspace is busy with --no-wait),
3 measurement failed, 4 internal error (a bug in flaloop), 130 interrupted. Every command takes
--json for agents: then stdout carries exactly one JSON document and human output goes to stderr.

Options shared by several commands are declared once, as an `OptionGroup` (a dataclass whose
fields carry their typer annotations); `with_options(Group)` adds the group's options to a
command's signature and hands the command one instance of the group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import inspect
import json
import os
import shlex
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, get_type_hints

import typer
import typer.exceptions
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flaloop import fsutil, git, locks
from flaloop.errors import FlaloopError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  pretty_exceptions_show_locals=False,
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
# errnos of an OSError that is the machine's answer (disk full, read-only, no permission), not a bug
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


@dataclass
class Settings:
    """Global options (given before the command: `flaloop --debug bench ...`)."""

    debug: bool = bool(os.environ.get("FLALOOP_DEBUG"))


settings = Settings()


@app.callback()
def _global_options(
    debug: Annotated[bool, typer.Option(
        "--debug", help="Print the traceback of any error (also FLALOOP_DEBUG=1).")] = False,
) -> None:
    settings.debug = settings.debug or debug


def emit_json(doc: dict) -> None:
    """The one JSON document of a --json run."""
    print(json.dumps(doc, default=str))


def _report(exc: FlaloopError, as_json: bool) -> None:
    if settings.debug:
        err.print(traceback.format_exc())
        if exc.detail:
            err.print(exc.detail)
    if as_json:
        emit_json({"ok": False, "error": exc.message, "hint": exc.hint, "exit_code": exc.exit_code})
    err.print(f"[bold red]error:[/] {escape(exc.message)}", markup=True)
    if exc.hint:
        err.print(f"  hint: {exc.hint}")


def command(fn: Callable) -> Callable:
    """Map FlaloopError to its exit code and message; survive Ctrl-C with exit 130; any other
    exception is a bug: exit 4 with one line, the traceback only with --debug."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return fn(*args, **kwargs)
        except FlaloopError as exc:
            _report(exc, as_json)
            raise typer.Exit(exc.exit_code) from None
        except (typer.Exit, typer.Abort, typer.exceptions.TyperException):
            raise  # typer.Exit carries the command's own exit code
        except OSError as exc:
            if exc.errno not in STORAGE_ERRNOS:
                return _internal_error(exc, as_json)
            _report(fsutil.storage_error(exc, exc.filename or "a file"), as_json)
            raise typer.Exit(2) from None
        except Exception as exc:  # noqa: BLE001 - the catch-all the exit code 4 promises
            return _internal_error(exc, as_json)
        except KeyboardInterrupt as exc:
            record = getattr(exc, "record_path", None)
            if as_json:
                emit_json({"ok": False, "error": "interrupted", "exit_code": 130, "record": record})
            err.print("interrupted: temporary worktrees and processes were cleaned up"
                      + (f"; the run record so far: {record}" if record else ""))
            raise typer.Exit(130) from None

    return wrapper


def _internal_error(exc: Exception, as_json: bool):
    if settings.debug:
        err.print(traceback.format_exc())
    message = f"internal error: {type(exc).__name__}: {exc}"
    if as_json:
        emit_json({"ok": False, "error": message, "hint": "rerun with --debug for the traceback; please report it",
                   "exit_code": INTERNAL_ERROR})
    err.print(f"{message} (rerun with --debug for the traceback; please report it)")
    raise typer.Exit(INTERNAL_ERROR) from None


def command_line() -> str:
    """This command as typed, quoted so that a shell reads it back the same (records keep it)."""
    return shlex.join(["flaloop", *sys.argv[1:]])


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


def config_options(name: str, config: type, extra: list[tuple[str, Any, Any]] | None = None,
                   namespace: dict | None = None) -> type:
    """An option group generated from a config dataclass (bench/model.BenchConfig): one option per
    field whose metadata says `cli`, spelled, typed and defaulted as the field declares (see
    bench/model.opt), so that an option is declared once. `extra` adds fields of the group's own
    ((name, annotation, default)); `namespace` its methods. A field the contract defaults
    (`from_contract`) is None (or off) unless given."""
    specs = []
    for f in dataclasses.fields(config):
        meta = f.metadata
        if not meta.get("cli", False):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        flags = tuple(meta.get("flags") or ()) or ("--" + f.name.replace("_", "-"),)
        help_ = meta.get("help", "")
        if meta.get("choices") and meta.get("kind") != "csv":
            help_ += f" One of: {', '.join(meta['choices'])}."
        if isinstance(default, bool):
            spelled = flags if not default else (f"{flags[0]}/--no-{flags[0][2:]}", *flags[1:])
            typ, value = bool, default
        elif meta.get("kind") == "csv":
            typ, value, spelled = str | None, None, flags
        elif meta.get("kind") == "assign":
            typ, value, spelled = list[str] | None, None, flags
        elif meta.get("unit") == "percent":
            typ, value, spelled = float, round(default * 100, 6), flags
        else:
            typ, value, spelled = type(default), default, flags
        if meta.get("from_contract") and not isinstance(default, bool):
            value = None
        specs.append((f.name, Annotated[typ, typer.Option(*spelled, help=help_, show_default=value is not None)],
                      dataclasses.field(default=value)))
    for fname, annotation, default in extra or []:
        specs.append((fname, annotation, dataclasses.field(default=default)))
    return dataclasses.make_dataclass(name, specs, namespace=namespace or {})


def _slot(group: type) -> str:
    name = group.__name__
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


@dataclass
class LockOptions:
    """Whether to queue behind another flaloop command that holds the op's workspace."""

    no_wait: Annotated[bool, typer.Option(
        "--no-wait", help="Fail with exit 2 instead of waiting when another flaloop command is "
                          "using this op's workspace (profile/<op>-opt/).")] = False

    @contextlib.contextmanager
    def hold(self, target, op: str, console: Console, command: str) -> Iterator[locks.Holder]:
        """Hold the op's workspace for the block (see flaloop.locks), after removing the worktrees
        that killed flaloop runs left behind, and saying so."""
        rel = os.path.relpath(target.workspace(op), target.root) + "/"
        with locks.workspace_lock(target, op, wait=not self.no_wait, command=command,
                                  on_wait=lambda h: console.print(locks.waiting_message(h, rel))) as me:
            for pid, path in git.reap_stale_worktrees(target.root):
                console.print(f"removed a worktree left by a killed flaloop run (pid {pid}): {path}")
            yield me
