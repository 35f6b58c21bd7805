"""Coding agents: `flaloop mcp`, a stdio MCP server whose tools are flaloop's commands, and
`flaloop skill install`, SKILL.md where agents look for skills.

A tool call runs the command itself, `python -m flaloop <command> ... --json`, as a child in its own
session, so that records, locks, cleanup and exit codes are exactly the CLI's: the result is that
command's one JSON document with its exit code. The tools' input schemas are read from the commands'
own declarations (typer's view of each signature, which holds the options generated from
`BenchConfig`), so an option is declared once, for the CLI, and its tool follows.

Progress: the CLI draws a rich progress bar, and only on a terminal, so the child's stderr is told
it is one (rich's TTY_COMPATIBLE/TTY_INTERACTIVE); each frame and line it writes, read as plain
text, becomes an MCP progress notification when it says something new. Cancellation (the client
cancels the call, or the session ends and this server goes) is a Ctrl-C of the child: SIGINT to
its process group, then flaloop's own interrupt handling stops the workers and pytest and removes
the worktrees; SIGKILL only if that takes longer than `INTERRUPT_GRACE_S`. The child also gets
SIGINT from the kernel when this server dies.

The MCP SDK (and pydantic, which it brings) is imported only when the server starts.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import difflib
import importlib.resources
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flaloop.cli.agent_tools import DETAIL, LOOP_COMMANDS, compact, meaning, tool_specs
from flaloop.cli.app import JsonOpt, app, command, emit_json, human
from flaloop.core import clock, fsutil, procs
from flaloop.core.errors import UsageError

if TYPE_CHECKING:
    import asyncio

INTERRUPT_GRACE_S = 60.0  # flaloop's own Ctrl-C cleanup: workers, pytest, worktrees, the run record so far
KILL_WAIT_S = 5.0
PIPE_DRAIN_S = 2.0  # after the child exits: a grandchild may still hold its pipes
TAIL_CHARS = 4000  # of a result without a document: its stderr's last lines, within agent_tools.RESULT_BOUND
# rich draws the CLI's progress bars only on an interactive terminal; plain text is all we read.
CHILD_ENV = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "NO_COLOR": "1"}
PROGRESS_NOISE = re.compile(r"[━╸╺╾╼]+|\b\d+:\d\d:\d\d\b|-:--:--")  # the bar and the elapsed time
RESULT_SCHEMA = {
    "type": "object",
    "properties": {
        "exit_code": {"type": "integer", "description": "The command's exit code (README: Exit codes)."},
        "meaning": {"type": "string", "description": "What that exit code means."},
        "result": {"type": ["object", "null"],
                   "description": "The command's --json document, compact (a run record as its table of cells; "
                                  "`detail: true` for the whole document): the result (ok true), or ok false with "
                                  "error, hint and exit_code. null when the command wrote none."},
        "next": {"type": "string", "description": "The loop's next step, after a loop command."},
        "stderr_tail": {"type": "string", "description": "The last lines it printed, when there is no result."},
    },
    "required": ["exit_code", "meaning", "result"],
}
SKILL_DIR = Path("~/.claude/skills")  # Claude Code's user skills


# -- one call: the command as a child -----------------------------------------------------------

def _sigint_on_parent_death() -> Callable[[], None] | None:
    """Like procs.spawn's PDEATHSIG, but SIGINT: a child whose server died cleans up as after a Ctrl-C."""
    prctl, parent = procs._PRCTL, os.getpid()  # noqa: SLF001 - the one libc prctl flaloop resolves
    if prctl is None:
        return None

    def preexec() -> None:  # between fork and exec: keep it tiny
        prctl(procs.PR_SET_PDEATHSIG, int(signal.SIGINT), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


async def _lines(stream: asyncio.StreamReader) -> AsyncIterator[str]:
    """What the child writes, a line or a redrawn progress frame (ended by \\r) at a time."""
    decoder, buf = codecs.getincrementaldecoder("utf-8")("replace"), ""
    while chunk := await stream.read(65536):
        *parts, buf = re.split(r"[\r\n]", buf + decoder.decode(chunk))
        for part in parts:
            yield part
    if buf:
        yield buf


def progress_text(raw: str) -> str:
    """A line of the child's stderr as plain text, without the bar and the clock (which change every frame)."""
    from rich.text import Text

    return " ".join(PROGRESS_NOISE.sub(" ", Text.from_ansi(raw).plain).split())


async def _interrupt(proc: asyncio.subprocess.Process) -> None:
    """Ctrl-C for the child's process group, as a terminal sends it; SIGKILL if its cleanup overruns.
    (No SIGTERM between: flaloop reads it as the same interrupt, and a second one only says "please wait".)"""
    import anyio

    for sig, wait_s in ((signal.SIGINT, INTERRUPT_GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with anyio.move_on_after(wait_s):
            await proc.wait()


async def run_command(argv: list[str], report: Callable[[float, float | None, str | None], Awaitable[None]],
                      cwd: str | None = None) -> dict[str, Any]:
    """Run `flaloop <argv>` (which holds --json) and return {exit_code, meaning, result[, stderr_tail]};
    every new thing it prints goes to `report(progress, total, message)`."""
    import asyncio  # here, not at the top: every other command starts faster without it

    import anyio

    # Forked by the event loop's thread, the main one: PDEATHSIG follows the thread that forked.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flaloop", *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, **CHILD_ENV}, cwd=cwd, start_new_session=True,
        preexec_fn=_sigint_on_parent_death())
    tail: collections.deque[str] = collections.deque(maxlen=40)
    stdout = bytearray()
    count = 0
    done = (anyio.Event(), anyio.Event())

    async def pump_stderr() -> None:
        nonlocal count
        try:
            async for raw in _lines(proc.stderr):
                text = progress_text(raw)
                if text and (not tail or tail[-1] != text):
                    tail.append(text)
                    count += 1
                    await report(count, None, text)
        finally:
            done[0].set()

    async def read_stdout() -> None:
        try:
            while chunk := await proc.stdout.read(1 << 16):
                stdout.extend(chunk)
        finally:
            done[1].set()

    try:
        count += 1
        await report(count, None, f"flaloop {shlex.join(argv)} (pid {proc.pid})")
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump_stderr)
            tg.start_soon(read_stdout)
            await proc.wait()
            with anyio.move_on_after(PIPE_DRAIN_S):  # a grandchild may still hold the pipes
                for event in done:
                    await event.wait()
            tg.cancel_scope.cancel()
    except BaseException:  # cancelled (the client, or the session's end), or anything else: Ctrl-C the child
        with anyio.CancelScope(shield=True):
            await _interrupt(proc)
        raise
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    try:
        doc = json.loads(stdout) if stdout.strip() else None
    except ValueError:
        doc = None
    out: dict[str, Any] = {"exit_code": code, "meaning": meaning(argv[0], code),
                           "result": doc if isinstance(doc, dict) else None}
    if out["result"] is None:
        out["stderr_tail"] = "\n".join(tail)
    return out


async def call(spec, model, arguments: dict, report, cwd: str | None = None) -> dict[str, Any]:
    """One tool call: the arguments checked as the CLI checks a command line, the command run, its
    document compact unless `detail`, and after a loop command the loop's next step."""
    values, refused = spec.check(model, arguments)
    if refused is not None:
        return {"exit_code": 2, "meaning": meaning(spec.name, 2), "result": refused}
    detail = bool(values.pop(DETAIL, False))
    out = await run_command(spec.argv(values), report, cwd)
    if spec.name in LOOP_COMMANDS and out["exit_code"] in (0, 1) and values.get("op"):
        extra = {k: values[k] for k in ("repo", "python") if values.get(k)}
        st = await run_command(specs_status().argv({"op": values["op"], **extra}), _quiet, cwd)
        if (st.get("result") or {}).get("next"):
            out["next"] = st["result"]["next"]
    elif isinstance(out["result"], dict) and isinstance(out["result"].get("next"), str):
        out["next"] = out["result"]["next"]
    if not detail:
        out["result"] = compact(out["result"])
        if len(out.get("stderr_tail", "")) > TAIL_CHARS:  # no document: what it printed last, within the bound
            out["stderr_tail"] = "..." + out["stderr_tail"][-TAIL_CHARS:]
    return out


async def _quiet(*_: Any) -> None:
    return None


def specs_status():
    return tool_specs(["status"])[0]


# -- the server ---------------------------------------------------------------------------------

def serve() -> None:
    """Serve the tools over stdio until the client closes the session."""
    import anyio

    anyio.run(_serve)


async def _serve() -> None:
    import mcp.types as types
    from mcp.server import Server
    from mcp.server.stdio import stdio_server
    from mcp.shared.exceptions import MCPError

    specs = {s.name: s for s in tool_specs()}
    models = {name: spec.model() for name, spec in specs.items()}
    tools = [types.Tool(name=name, description=spec.description, input_schema=models[name].model_json_schema(),
                        output_schema=RESULT_SCHEMA) for name, spec in specs.items()]

    async def list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        spec = specs.get(params.name)
        if spec is None:
            close = difflib.get_close_matches(params.name, list(specs), n=3, cutoff=0.5)
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}: "
                           + (f"did you mean {' or '.join(close)}? " if close else "") + f"one of {', '.join(specs)}")
        out = await call(spec, models[spec.name], params.arguments or {}, ctx.session.report_progress)
        return types.CallToolResult(content=[types.TextContent(type="text", text=json.dumps(out, default=str))],
                                    structured_content=out, is_error=out["exit_code"] not in (0, 1))

    server = Server("flaloop", version=_version(), on_list_tools=list_tools, on_call_tool=call_tool,
                    instructions="flaloop's commands as tools: each runs `flaloop <command> --json` and returns "
                                 "its exit code, what it means, its JSON document made compact (`detail: true` "
                                 "for all of it) and the loop's next step. Read the flaloop skill (SKILL.md) "
                                 "first.")
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flaloop")
    except PackageNotFoundError:
        return "0"


@app.command("mcp")
@command
def mcp_cmd() -> None:
    """Serve flaloop's commands as MCP tools over stdio, for coding agents.

    Every command of the loop is a tool (not mcp, demo, skill), its parameters the command's long
    options with underscores (--target: target, --input: input, -k: k); each runs the command with
    --json and returns its exit code, what it means, a compact result (the table of cells, the record's
    path; `detail: true` for the whole document) and the loop's next step, with progress notifications
    while it runs; cancelling a call interrupts it like Ctrl-C. Needs the mcp extra (pip install
    'flaloop[mcp]'). An agent's MCP config: {"command": "flaloop", "args": ["mcp"]}.
    """
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise UsageError("flaloop mcp needs the MCP SDK", "pip install 'flaloop[mcp]'") from None
    serve()


# -- skill install ------------------------------------------------------------------------------

def skill_text() -> str:
    """SKILL.md: shipped inside the package in a wheel (setup.py copies it there), else the checkout's."""
    shipped = importlib.resources.files("flaloop") / "SKILL.md"
    if shipped.is_file():
        return shipped.read_text()
    checkout = Path(__file__).resolve().parents[2] / "SKILL.md"  # an editable install, or PYTHONPATH
    if checkout.is_file():
        return checkout.read_text()
    raise UsageError("this installation of flaloop has no SKILL.md", "reinstall flaloop (pip install flaloop)")


@app.command("skill")
@command
def skill_cmd(
    action: Annotated[str, typer.Argument(help="install")],
    to: Annotated[Path | None, typer.Option(
        "--to", help="Skills directory (default: ~/.claude/skills, Claude Code's user skills; a project's "
                     "skills live in .claude/skills of its repo).")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace a different SKILL.md there (the old one is kept beside it as .bak).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Install flaloop's SKILL.md where coding agents look for skills: DIR/flaloop/SKILL.md."""
    if action != "install":
        raise UsageError(f"unknown skill action {action!r}", "use `flaloop skill install [--to DIR]`")
    dest = (to or SKILL_DIR).expanduser() / "flaloop" / "SKILL.md"
    text, backup, state = skill_text(), None, "installed"
    if dest.exists():
        old = dest.read_text(errors="replace")
        if old == text:
            state = "unchanged"
        elif not force:
            raise UsageError(f"{dest} exists and is not flaloop's SKILL.md",
                             "compare them; rerun with --force to replace it (yours is kept as a .bak file)")
        else:
            backup = dest.with_name(f"SKILL.md.{clock.local_stamp()}.bak")
            fsutil.atomic_write_text(backup, old)
            state = "replaced"
    if state != "unchanged":
        fsutil.atomic_write_text(dest, text)
    if as_json:
        emit_json({"ok": True, "path": str(dest), "state": state, "backup": str(backup) if backup else None})
    human(as_json).print(f"{state}: {dest}" + (f" (the old one: {backup})" if backup else ""))
