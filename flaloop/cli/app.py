"""The typer app, the two consoles, the error-to-exit-code wrapper and the options every command shares.

Exit codes: 0 verdict delivered / gate green, 1 gate red or guard blocked (or, with --fail-on
slower, a SLOWER verdict: `fail_on_exit`), 2 usage or setup error
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
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, get_type_hints

import typer
import typer.exceptions
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from typer.core import TyperGroup

from flaloop.core import fsutil, git, locks
from flaloop.core.errors import FlaloopError

try:  # typer vendors click from 0.2x on; before, it used click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # noqa: F401

# The commands under their headings, in the order a loop runs them: `--help` lists them so, and the
# MCP server's tools follow COMMAND_ORDER too. A command in no section is listed under "Other".
COMMAND_SECTIONS = (
    ("Set up", ("list", "init", "gate", "audit")),
    ("The loop", ("baseline", "iter", "status", "log", "header", "trap", "reassess", "dispatch", "stop", "report")),
    ("Measure and look closer", ("bench", "verify", "compare", "sweep", "model", "profile", "explain", "sanitize")),
    ("Housekeeping and agents", ("clean", "skill", "mcp", "demo")),
)
COMMAND_ORDER = tuple(name for _, names in COMMAND_SECTIONS for name in names)


class LoopOrderGroup(TyperGroup):
    """The root command: its commands listed in the loop's order, under COMMAND_SECTIONS' headings."""

    def list_commands(self, ctx) -> list[str]:
        return sorted(self.commands, key=lambda n: (COMMAND_ORDER.index(n) if n in COMMAND_ORDER
                                                    else len(COMMAND_ORDER), n))

    def format_commands(self, ctx, formatter) -> None:
        names = [n for n in self.list_commands(ctx) if not self.commands[n].hidden]
        if not names:
            return
        limit = formatter.width - 6 - max(len(n) for n in names)
        placed = {n for _, section in COMMAND_SECTIONS for n in section}
        for title, section in (*COMMAND_SECTIONS, ("Other", tuple(n for n in names if n not in placed))):
            width = max(len(n) for n in names)  # one column for every heading
            rows = [(n.ljust(width), self.commands[n].get_short_help_str(limit)) for n in section if n in names]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


app = typer.Typer(cls=LoopOrderGroup, add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  pretty_exceptions_show_locals=False, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Make GPU kernels faster without breaking or gaming correctness.")


def _width(stream) -> int | None:
    """A terminal, or COLUMNS when set: rich's own detection. Otherwise (CI, agents, pipes, files)
    200 columns for text, where rich would assume 80 and cut paths; tables print at their full
    width there (report/terminal.print_table)."""
    return None if stream.isatty() or os.environ.get("COLUMNS", "").isdigit() else 200


# markup is off by default: test ids, diffs and messages are full of [brackets]. Literal styled
# strings opt in with markup=True and escape() whatever they interpolate. Emoji codes are off too:
# a message about `--input a=neg:b` printed "neg🅱" (rich reads ":b:" as an emoji's name).
out = Console(highlight=False, soft_wrap=True, markup=False, emoji=False, width=_width(sys.stdout))
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False, width=_width(sys.stderr))

RepoOpt = Annotated[str | None, typer.Option("--repo", help="Target checkout (default: the git root of the cwd).")]
PyOpt = Annotated[str | None, typer.Option("--python", help="Target's interpreter (default: this one).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document on stdout, for agents.")]


class FailOn(str, Enum):
    slower = "slower"


FailOnOpt = Annotated[FailOn | None, typer.Option(
    "--fail-on", help="slower: exit 1 when any cell (or the geomean) is SLOWER beyond the margin, for CI.")]
FAIL_ON_EXIT = 1  # a verdict that refuses, like a red gate (README's exit-code table)

INTERNAL_ERROR = 4
# errnos of an OSError that is the machine's answer (disk full, read-only, no permission), not a bug
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


@dataclass
class Settings:
    """Global options (given before the command: `flaloop --debug bench ...`)."""

    debug: bool = bool(os.environ.get("FLALOOP_DEBUG"))


settings = Settings()


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"flaloop {version('flaloop')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            print("flaloop (not installed: run from a source checkout)")
        raise typer.Exit(0)


@app.callback()
def _global_options(
    debug: Annotated[bool, typer.Option(
        "--debug", help="Print the traceback of any error (also FLALOOP_DEBUG=1); anywhere on the line.")] = False,
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                          help="Print flaloop's version and exit.")] = False,
) -> None:
    settings.debug = settings.debug or debug


# -- the command line before click reads it ---------------------------------------------------------

# A str option whose value is a comma list declares this metavar; options with multiple=True are
# lists too. Both take `--opt A B`, `--opt A,B` and `--opt A --opt B` alike (normalize_argv).
LIST = "A,B"


def _resolve(group, argv: list[str]):
    """The (sub)command the line names: group names are followed while the next word is one."""
    cmd = group
    for word in argv:
        if word.startswith("-"):
            continue
        sub = getattr(cmd, "commands", {}).get(word)
        if sub is None:
            break
        cmd = sub
    return cmd


def _value_word(word: str) -> bool:
    """A word that can be one more value of a list option: not an option, no whitespace (a
    direction or a message, which are positional, always has some)."""
    return bool(word) and not word.startswith("-") and not any(c.isspace() for c in word)


def _split(value: str) -> list[str]:
    return [value] if "=" in value else [v for v in value.split(",") if v]  # `--input k=v` keeps its commas


def normalize_argv(argv: list[str], root) -> list[str]:
    """One spelling for every list option, whatever the user typed: repeated `--opt v` for
    multiple=True options, one `--opt A,B` for comma-list options (see LIST)."""
    cmd = _resolve(root, argv)
    opts = {name: p for p in getattr(cmd, "params", []) if getattr(p, "param_type_name", "") == "option"
            for name in p.opts}
    lists = {n: p for n, p in opts.items() if p.multiple or p.metavar == LIST}
    out_args: list[str] = []
    joined: dict[str, int] = {}  # comma-list option -> its index in out_args
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            out_args += argv[i:]
            break
        name, eq, inline = word.partition("=")
        p = lists.get(name) if word.startswith("--") else lists.get(word)
        if p is None:
            out_args.append(word)
            i += 1
            continue
        values: list[str] = []
        if eq:
            values.append(inline)
            i += 1
        elif i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
        else:
            out_args.append(word)  # click says the value is missing
            i += 1
            continue
        while i < len(argv) and _value_word(argv[i]):
            values.append(argv[i])
            i += 1
        items = [v for raw in values for v in _split(raw)]
        flag = p.opts[0]
        if p.multiple:
            for v in items:
                out_args += [flag, v]
        elif flag in joined:
            out_args[joined[flag]] += "," + ",".join(items)
        else:
            out_args += [flag, ",".join(items)]
            joined[flag] = len(out_args) - 1
    return out_args


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
                emit_json({"ok": False, "error": "interrupted", "exit_code": 130, "record": record,
                           "hint": "temporary worktrees and processes were cleaned up; run the command again"
                                   + (f" (the run record so far: {record})" if record else "")})
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


def fail_on_exit(code: int, fail_on: FailOn | None, slower: list[str], console: Console | None = None) -> int:
    """The exit code with `--fail-on slower`: a command that would exit 0 exits FAIL_ON_EXIT when
    anything is SLOWER (`slower` names it); any other code (blocked, bad input, failed) stands."""
    if fail_on is None or not slower or code != 0:
        return code
    if console is not None:
        console.print(f"--fail-on slower: SLOWER on {', '.join(slower)}: exit {FAIL_ON_EXIT}")
    return FAIL_ON_EXIT


def command_line() -> str:
    """This command as typed, quoted so that a shell reads it back the same (records keep it)."""
    return shlex.join(["flaloop", *sys.argv[1:]])


def human(as_json: bool) -> Console:
    """Where human-readable output goes: stderr when stdout is reserved for JSON."""
    return err if as_json else out


class _Progress(Progress):
    """rich's progress bar on a terminal. Elsewhere (CI logs, an agent reading stderr, a detached run)
    rich draws nothing, so a long run would say nothing for minutes: there each task prints one plain
    line on stderr when its description changes, and a heartbeat with its count every
    `HEARTBEAT_S` while it does not, each with the time since the start."""

    HEARTBEAT_S = 30.0

    def __init__(self, *columns, **kwargs):
        super().__init__(*columns, **kwargs)
        self._plain = not self.console.is_terminal
        self._t0 = time.monotonic()
        self._said: dict = {}  # task id -> (description, when said)

    def add_task(self, description, *args, **kwargs):
        task_id = super().add_task(description, *args, **kwargs)
        self._say(task_id, description)
        return task_id

    def update(self, task_id, *args, description=None, **kwargs):
        super().update(task_id, *args, description=description, **kwargs)
        self._say(task_id, description)

    def _say(self, task_id, description) -> None:
        if not self._plain:
            return
        now = time.monotonic()
        was, when = self._said.get(task_id, (None, 0.0))
        if description is None or description == was:
            if was is None or now - when < self.HEARTBEAT_S:
                return
            task = next((t for t in self.tasks if t.id == task_id), None)
            count = f" ({task.completed:g}{'/' + format(task.total, 'g') if task and task.total else ''})" if task else ""
            description = f"{was}{count}"
            self._said[task_id] = (was, now)
        else:
            self._said[task_id] = (description, now)
        err.print(f"[{now - self._t0:7.1f}s] {description}")


def progress_bar(console: Console) -> Progress:
    return _Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
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
        # which group each option came from: `--help` lists them under the group's heading (cli/help.py)
        wrapper.__option_groups__ = {**getattr(fn, "__option_groups__", {}),  # type: ignore[attr-defined]
                                     **{name: slots[slot].__name__ for slot in fields for name in fields[slot]}}
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
        extra_kw: dict = {}
        if meta.get("choices") and meta.get("kind") != "csv":
            help_ += f" One of: {', '.join(meta['choices'])}."
        if isinstance(default, bool):
            spelled = flags if not default else (f"{flags[0]}/--no-{flags[0][2:]}", *flags[1:])
            typ, value = bool, default
        elif meta.get("kind") == "csv":
            typ, value, spelled = str | None, None, flags
            extra_kw = {"metavar": LIST}
        elif meta.get("kind") == "assign":
            typ, value, spelled = list[str] | None, None, flags
        elif meta.get("unit") == "percent":
            typ, value, spelled = float, round(default * 100, 6), flags
        else:
            typ, value, spelled = type(default), default, flags
        if meta.get("from_contract") and not isinstance(default, bool):
            value = None
        specs.append((f.name, Annotated[typ, typer.Option(*spelled, help=help_, show_default=value is not None,
                                                          **extra_kw)],
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
        """Hold the op's workspace for the block (see flaloop.core.locks), after removing the worktrees
        that killed flaloop runs left behind, and saying so."""
        rel = os.path.relpath(target.workspace(op).path, target.root) + "/"
        with locks.workspace_lock(target, op, wait=not self.no_wait, command=command,
                                  on_wait=lambda h: console.print(locks.waiting_message(h, rel))) as me:
            for pid, path in git.reap_stale_worktrees(target.root):
                console.print(f"removed a worktree left by a killed flaloop run (pid {pid}): {path}")
            git.reap_stale_tempdirs()
            yield me
