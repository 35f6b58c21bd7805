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
from support.cli import flaloop
from support.repos import OP, ROOT, edit, git, make_repo, make_toy_repo

from flaloop.core import procs

pytest.importorskip("mcp")
import anyio  # noqa: E402  (comes with mcp)
from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402

from flaloop.cli.agent_tools import (  # noqa: E402
    RESULT_BOUND,
    tool_names,
)

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


TOY = "toy_attn"
FAST = Path("toyop/ops/toy/fast.py")
SLEEP = "    import time; time.sleep(0.005)\n    scale = q.shape"  # the slow base: deterministic on a busy CPU
WRONG = ("return o.to(q.dtype), None", "return (o * 1.5).to(q.dtype), None")
TOY_QUICK = {**QUICK, "unseen_shapes": 0}


def test_an_agent_runs_the_whole_loop_to_a_go_with_tool_calls_only(tmp_path):
    """init, baseline, an honest change, a stall, reassess, stop --go, report: only tool calls, and
    every result, text and structured, within RESULT_BOUND."""
    repo = make_toy_repo(tmp_path / "toy")
    edit(repo / FAST, "    scale = q.shape", SLEEP)
    git(repo, "commit", "-qam", "a slow base")
    sizes: dict[str, int] = {}

    async def call(s, name: str, args: dict, progress=None) -> dict:
        r = await s.call_tool(name, args, progress_callback=progress)
        out = r.structured_content
        text = r.content[0].text
        assert json.loads(text) == out
        sizes[name] = max(sizes.get(name, 0), len(text.encode()))
        assert len(text.encode()) <= RESULT_BOUND, (name, len(text))
        assert r.is_error == (out["exit_code"] not in (0, 1))
        return out

    async def story() -> None:
        async with agent_session(repo) as s:
            tools = {t.name: t for t in (await s.list_tools()).tools}
            assert list(tools) == tool_names()
            assert {"stop", "reassess", "explain", "compare", "clean", "sanitize", "trap", "dispatch", "header",
                    "log"} <= set(tools)
            init = tools["init"].input_schema["properties"]
            assert {"target", "input", "max_iters", "detail"} <= set(init) and "target_speedup" not in init
            assert tools["bench"].input_schema["properties"]["min_pairs"]["default"] == 16
            assert "k" in tools["gate"].input_schema["properties"]

            out = await call(s, "list", {})
            assert out["exit_code"] == 0 and out["meaning"].startswith("done: the target's ops")
            assert TOY in json.dumps(out["result"])

            # the CLI's parameter name misspelled: one sentence, a hint with the close name, nothing run
            out = await call(s, "init", {"op": TOY, "target_speedup": "1.5x"})
            assert out["exit_code"] == 2 and "\n" not in out["result"]["error"]
            assert "target_speedup" in out["result"]["error"] and "did you mean target" in out["result"]["hint"]
            assert "pydantic" not in json.dumps(out)
            out = await call(s, "bench", {"op": TOY, "min_pairs": "many"})
            assert out["exit_code"] == 2 and "min_pairs" in out["result"]["error"] and out["result"]["hint"]
            assert not (repo / "profile").exists()

            out = await call(s, "init", {"op": TOY, "shapes": ["B2_T64_H2_D16"], "modes": "fwd", "target": "1.5x"})
            assert out["exit_code"] == 0 and out["result"]["target_speedup"] == 1.5, out
            assert out["next"] == f"flaloop baseline {TOY}"

            progress = Progress()
            out = await call(s, "baseline", {"op": TOY, **TOY_QUICK}, progress)
            assert out["exit_code"] == 0, out
            assert out["meaning"] == "done: the baseline recorded" and out["next"].startswith("edit the kernel")
            messages = [m for _, m in progress.events]
            assert any("warm-up" in m for m in messages) and any("pairs" in m for m in messages), messages

            edit(repo / FAST, SLEEP, "    scale = q.shape")  # the honest change
            out = await call(s, "iter", {"op": TOY, "direction": "drop the sleep", **TOY_QUICK})
            assert out["exit_code"] == 0 and out["result"]["iteration"]["status"] == "keep", out
            assert out["next"] == f"flaloop stop {TOY} --go"

            for n in (1, 2, 3):  # red gates: dropped, reverted
                edit(repo / FAST, *WRONG)
                out = await call(s, "iter", {"op": TOY, "direction": f"wrong scale {n}", **TOY_QUICK})
                assert out["exit_code"] == 1 and out["result"]["iteration"]["status"] == "drop", out
            edit(repo / FAST, *WRONG)
            out = await call(s, "iter", {"op": TOY, "direction": "one more", **TOY_QUICK})
            assert out["exit_code"] == 1 and "stalled" in out["result"]["error"], out
            assert "reassess" in out["result"]["hint"]
            git(repo, "checkout", "--", str(FAST))

            out = await call(s, "reassess", {"op": TOY, "profiled": "the sleep was all of it", "tried": "scaling",
                                              "next": "stop: the target is met", "why": "nothing left to take"})
            assert out["exit_code"] == 0 and out["meaning"].startswith("done: the re-assessment"), out
            out = await call(s, "status", {"op": TOY})
            assert out["exit_code"] == 0 and out["result"]["phase"] == "target met"
            assert out["meaning"] == "done: where the loop stands" and out["next"] == f"flaloop stop {TOY} --go"

            # the go profiles both sides itself (no explanation recorded): 2 steps a round, the fewest it
            # takes; the 5 ms sleep is most of each base step, so the share it explains is near 1 at any count
            out = await call(s, "stop", {"op": TOY, "go": True, "steps": 4})
            assert out["exit_code"] == 0, out
            assert out["next"] == f"flaloop report {TOY}"
            out = await call(s, "report", {"op": TOY, "no_plots": True})
            assert out["exit_code"] in (0, 1), out
            assert out["result"]["records"]["claim"].endswith("record.json")
            full = await s.call_tool("report", {"op": TOY, "no_plots": True, "detail": True})
            assert len(full.content[0].text) > len(json.dumps(out))  # the whole document on request
            assert full.structured_content["result"]["cells"][0]["id"] == "B2_T64_H2_D16/fwd"

            # the loop's other commands, each a tool with a bounded result
            out = await call(s, "header", {"op": TOY, "iter": 1})
            assert out["exit_code"] == 0 and "#1 drop the sleep" in out["result"]["text"], out
            out = await call(s, "log", {"op": TOY})
            assert out["exit_code"] == 0, out
            out = await call(s, "trap", {"action": "add", "op": TOY, "fact": "a sleep dominates", "why": "it hides the op",
                                         "how": "profile first"})
            assert out["exit_code"] == 0 and out["result"]["trap"] == 11, out
            out = await call(s, "dispatch", {"action": "list", "op": TOY})
            assert out["exit_code"] == 0, out
            out = await call(s, "audit", {"op": TOY})
            assert out["exit_code"] in (0, 1) and out["result"]["ok"], out
            runs = sorted((repo / "profile" / f"{TOY}-opt" / "runs").glob("*/record.json"))
            out = await call(s, "compare", {"a": str(runs[0]), "b": str(runs[-1])})
            assert out["exit_code"] == 0, out
            out = await call(s, "clean", {"op": TOY, "dry_run": True})
            assert out["exit_code"] == 0 and out["meaning"] == "done: cleaned", out

    anyio.run(story)
    print("largest result per tool (bytes):", sizes)


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


# -- the tools' declarations, checks and results, in-process --------------------------------------


