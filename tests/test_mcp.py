"""A coding agent drives flaloop over MCP: `python -m flaloop mcp`, spoken to by the MCP SDK's own
stdio client, on a copy of examples/minifla; and `flaloop skill install`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import OP, ROOT, flaloop, make_repo

from flaloop import procs

pytest.importorskip("mcp")
import anyio  # noqa: E402  (comes with mcp)
from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402

from flaloop.cli.agent import TOOLS  # noqa: E402

QUICK = {"device": "cpu", "min_pairs": 4, "max_pairs": 8, "rounds": 1, "cell_seconds": 5, "sample_ms": 2}
LONG = {"device": "cpu", "min_pairs": 400, "max_pairs": 400, "rounds": 1, "cell_seconds": 600, "sample_ms": 2}


@contextlib.asynccontextmanager
async def agent_session(repo: Path):
    """An MCP client session with `python -m flaloop mcp` started in `repo`."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "flaloop", "mcp"], cwd=str(repo),
                                   env={**os.environ, "TRITON_INTERPRET": "1"})
    with open(repo.parent / "server.stderr", "a") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


def worktrees(repo: Path) -> list[str]:
    out = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=repo, capture_output=True, text=True,
                         check=True).stdout
    return [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("worktree ")]


class Progress:
    """What a call's progress notifications said; `pid` is the flaloop child's (the first message)."""

    def __init__(self, wait_for: str | None = None) -> None:
        self.events: list[tuple[float, str]] = []
        self.pid: int | None = None
        self.seen = anyio.Event()
        self.wait_for = wait_for

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.events.append((progress, message or ""))
        if self.pid is None and (m := re.search(r"\(pid (\d+)\)", message or "")):
            self.pid = int(m.group(1))
        if self.wait_for and self.wait_for in (message or ""):
            self.seen.set()


def test_an_agent_lists_inits_and_benches_over_mcp(tmp_path):
    repo = make_repo(tmp_path / "minifla")

    async def story() -> None:
        async with agent_session(repo) as s:
            tools = {t.name: t for t in (await s.list_tools()).tools}
            assert list(tools) == list(TOOLS)
            bench = tools["bench"].input_schema
            assert bench["required"] == ["op"]
            # the bench's options come from BenchConfig's declaration, typed
            assert bench["properties"]["min_pairs"]["type"] == "integer"
            assert bench["properties"]["min_pairs"]["default"] == 16
            assert {"shapes", "modes", "cell_seconds", "device", "base", "quick", "repo"} <= set(bench["properties"])
            assert "direction" in tools["iter"].input_schema["properties"]
            assert tools["bench"].output_schema["required"] == ["exit_code", "meaning", "result"]

            r = await s.call_tool("list", {})
            assert r.structured_content["exit_code"] == 0, r.structured_content
            assert OP in json.dumps(r.structured_content["result"])

            r = await s.call_tool("init", {"op": OP, "shapes": ["B1_T64_H2_D32"], "modes": "fwd"})
            assert r.structured_content["exit_code"] == 0, r.structured_content
            assert r.structured_content["result"]["shapes"] == ["B1_T64_H2_D32"]
            assert (repo / "profile" / f"{OP}-opt" / "contract.json").is_file()

            progress = Progress()
            r = await s.call_tool("bench", {"op": OP, **QUICK}, progress_callback=progress)
            out = r.structured_content
            assert out["exit_code"] == 0 and not r.is_error, out
            assert out["meaning"].startswith("done")
            assert [c["cell"]["shape_name"] + "/" + c["cell"]["mode"] for c in out["result"]["cells"]] \
                == ["B1_T64_H2_D32/fwd"]
            messages = [m for _, m in progress.events]
            assert any("warm-up" in m for m in messages) and any("pairs" in m for m in messages), messages
            counts = [p for p, _ in progress.events]
            assert counts == sorted(set(counts))  # each notification says something new
            assert worktrees(repo) == [str(repo)]

            # a command's own refusal comes back as its result: exit 2 with the error and a hint
            r = await s.call_tool("status", {"op": "chunk_linear_atn"})
            assert r.structured_content["exit_code"] == 2 and r.is_error
            assert r.structured_content["result"]["ok"] is False
            assert "flaloop init" in r.structured_content["result"]["hint"]
            # arguments the command does not take are refused before anything runs
            r = await s.call_tool("bench", {"op": OP, "min_pairs": "many", "pairs": 3})
            assert r.structured_content["exit_code"] == 2
            assert "min_pairs" in r.structured_content["result"]["error"]

    anyio.run(story)


def test_a_cancelled_call_and_an_ended_session_clean_up_like_ctrl_c(tmp_path):
    repo = make_repo(tmp_path / "minifla")
    assert flaloop(repo, "init", OP, "--shapes", "B1_T64_H2_D32", "--modes", "fwd").code == 0

    def interrupted_runs() -> int:
        records = (repo / "profile" / f"{OP}-opt" / "runs").glob("*/record.json")
        return sum(json.loads(r.read_text()).get("interrupted") is True for r in records)

    async def gone(pid: int) -> None:
        with anyio.fail_after(90):
            while procs.running(pid):
                await anyio.sleep(0.1)

    async def story() -> None:
        async with agent_session(repo) as s:
            progress = Progress(wait_for="warm-up")
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: s.call_tool("bench", {"op": OP, **LONG}, progress_callback=progress))
                with anyio.fail_after(120):
                    await progress.seen.wait()
                assert procs.running(progress.pid) and len(worktrees(repo)) == 3  # base and candidate
                tg.cancel_scope.cancel()  # the client gives up on the call: notifications/cancelled
            await gone(progress.pid)
            assert worktrees(repo) == [str(repo)]
            assert interrupted_runs() == 1  # the record says so: the bench did not just finish
            r = await s.call_tool("status", {"op": OP})  # the server goes on serving
            assert r.structured_content["exit_code"] == 0

        # the agent goes away in the middle of a call: the session ends, the server with it
        progress = Progress(wait_for="warm-up")
        async with anyio.create_task_group() as tg:
            async with agent_session(repo) as s:
                async def call() -> None:
                    with contextlib.suppress(Exception):  # its answer never comes
                        await s.call_tool("bench", {"op": OP, **LONG}, progress_callback=progress)

                tg.start_soon(call)
                with anyio.fail_after(120):
                    await progress.seen.wait()
            tg.cancel_scope.cancel()
        await gone(progress.pid)
        assert worktrees(repo) == [str(repo)]
        assert interrupted_runs() == 2

    anyio.run(story)


def test_skill_install_puts_skill_md_where_claude_code_looks(tmp_path):
    home = tmp_path / "home"
    r = flaloop(tmp_path, "skill", "install", "--json", env={"HOME": str(home)})
    assert r.code == 0, r.stderr
    dest = home / ".claude" / "skills" / "flaloop" / "SKILL.md"
    assert r.json["path"] == str(dest) and r.json["state"] == "installed"
    assert dest.read_text() == (ROOT / "SKILL.md").read_text()
    r = flaloop(tmp_path, "skill", "install", "--json", env={"HOME": str(home)})
    assert r.code == 0 and r.json["state"] == "unchanged"


def test_skill_install_never_overwrites_a_different_file_without_force(tmp_path):
    skills = tmp_path / "project" / ".claude" / "skills"
    dest = skills / "flaloop" / "SKILL.md"
    dest.parent.mkdir(parents=True)
    dest.write_text("my own notes\n")
    r = flaloop(tmp_path, "skill", "install", "--to", str(skills), "--json")
    assert r.code == 2 and "--force" in r.json["hint"]
    assert dest.read_text() == "my own notes\n"
    r = flaloop(tmp_path, "skill", "install", "--to", str(skills), "--force", "--json")
    assert r.code == 0 and r.json["state"] == "replaced"
    assert dest.read_text() == (ROOT / "SKILL.md").read_text()
    assert Path(r.json["backup"]).read_text() == "my own notes\n"
