"""The MCP tools, in-process: every command is a tool or excluded with a reason, tool parameters are
the CLI's long options, results are bounded and say what their exit code means. An agent driving
`python -m flaloop mcp` over stdio is in tests/e2e/test_mcp.py."""

from __future__ import annotations

import json

import pytest
from support.repos import OP

pytest.importorskip("mcp")
import anyio  # noqa: E402  (comes with mcp)

from flaloop.cli import agent_tools  # noqa: E402
from flaloop.cli.agent_tools import (  # noqa: E402
    ENVELOPE,
    EXCLUDED,
    RESULT_BOUND,
    compact,
    size,
    tool_names,
    tool_specs,
)


def _click_commands() -> dict:
    import typer.main

    from flaloop.cli import app, load_commands

    load_commands()
    return typer.main.get_command(app).commands


def test_every_command_is_a_tool_or_excluded_with_a_reason():
    commands = set(_click_commands())
    assert not set(EXCLUDED) - commands, "an exclusion names no command"
    assert set(tool_names()) == commands - set(EXCLUDED)
    assert all(len(why.split()) >= 5 for why in EXCLUDED.values())
    # the loop's order: what SKILL.md walks an agent through comes first
    assert tool_names()[:6] == ["list", "init", "gate", "audit", "baseline", "iter"]


def test_tool_parameters_are_the_clis_long_options_with_underscores():
    commands = _click_commands()
    for spec in tool_specs():
        expected = set()
        for p in commands[spec.name].params:
            if p.param_type_name == "option":
                if "--json" in p.opts:
                    continue
                flag = next((o for o in p.opts if o.startswith("--")), p.opts[0])
                expected.add(flag.lstrip("-").replace("-", "_"))
            else:
                expected.add(p.name)
        assert {p.name for p in spec.params} == expected, spec.name
        # each parameter's command line reaches the command's own parameter
        for p in spec.params:
            if p.flag is None or p.annotation is bool or "bool" in str(p.annotation):
                continue
            argv = spec.argv({p.name: "1"})
            assert argv[1:3] == [p.flag, "1"] and p.flag in {o for q in commands[spec.name].params for o in q.opts}
    init = {p.name: p for p in tool_specs(["init"])[0].params}
    assert {"target", "input", "shapes", "max_iters", "keep_base", "new_loop"} <= set(init)
    assert init["target"].py_name == "target_speedup" and init["input"].py_name == "inputs"
    assert {p.name for p in tool_specs(["gate"])[0].params} >= {"k", "timeout"}
    assert {p.name for p in tool_specs(["report"])[0].params} >= {"format", "out", "no_plots"}


def test_a_bad_call_is_answered_as_the_cli_answers_a_usage_error():
    spec = tool_specs(["init"])[0]
    model = spec.model()
    values, err = spec.check(model, {"op": OP, "target": "1.1x", "input": ["k=l2norm"]})
    assert err is None and values == {"op": OP, "target": "1.1x", "input": ["k=l2norm"]}
    assert spec.argv(values) == ["init", "--target", "1.1x", "--input", "k=l2norm", "--json", OP]
    values, err = spec.check(model, {"op": OP, "shapes": "A,B"})  # one string where a list goes
    assert err is None and spec.argv(values) == ["init", "--shapes", "A,B", "--json", OP]
    for args, said, hinted in (
            ({"op": OP, "target_speedup": "1.1x"}, "init has no parameter 'target_speedup'", "did you mean target"),
            ({"op": OP, "inputs": ["k=l2norm"]}, "no parameter 'inputs'", "did you mean input"),
            ({"target": "1.1x"}, "init needs the parameter 'op'", "required parameters: op"),
            ({"op": OP, "max_iters": "many"}, "bad value 'many' for max_iters of init", "Iteration cap")):
        values, err = spec.check(model, args)
        assert values is None and err["exit_code"] == 2 and err["ok"] is False
        assert said in err["error"] and hinted in err["hint"], err
        assert "\n" not in err["error"] and "pydantic" not in json.dumps(err)


def _huge_record(n_cells: int) -> dict:
    pairs = [{"base_ms": 1.0 + i / 1e3, "cand_ms": 0.7, "round": 1, "foreign": []} for i in range(60)]
    cells = [{"cell": {"shape_name": f"B1_T{64 * (i + 1)}_H2_D32", "mode": "fwd"}, "status": "ok", "verdict": "FASTER",
              "estimate": {"speedup": 1.4321987, "ci_low": 1.3, "ci_high": 1.5}, "pairs": pairs, "reason": ""}
             for i in range(n_cells)]
    return {"ok": True, "op": OP, "config": {"aa": False}, "base": {"commit": "a" * 40},
            "candidate": {"commit": "b" * 40}, "cells": cells, "path": "/some/where/runs/20260101T000000Z-bench/record.json",
            "summary": {"geomean": {"speedup": 1.43, "ci_low": 1.3, "ci_high": 1.5}, "n_cells": n_cells},
            "guard": {"blocked": False, "findings": [{"rule": "r", "message": "m" * 5000}] * 40}}


def test_compact_results_stay_within_the_bound_and_keep_what_an_agent_decides_on():
    rec = _huge_record(12)
    assert size(rec) > 10 * RESULT_BOUND
    out = compact(rec)
    assert size(out) <= RESULT_BOUND - ENVELOPE
    assert out["record"] == rec["path"] and out["geomean"]["speedup"] == 1.43
    assert [c["cell"] for c in out["cells"]][:2] == ["B1_T64_H2_D32/fwd", "B1_T128_H2_D32/fwd"]
    assert out["cells"][0]["verdict"] == "FASTER" and out["cells"][0]["ci"] == [1.3, 1.5]
    # a record inside another document (verify's gate and bench), and documents of no known shape
    for doc in ({"ok": True, "gate": {"green": True}, "bench": _huge_record(400)},
                {"ok": True, "rows": [{"key": f"c{i}", "text": "x" * 900, "nested": {"a": [list(range(50))]}}
                                      for i in range(3000)], "path": "/p/sweep.json"},
                {"ok": False, "error": "e" * 20000, "hint": "h", "exit_code": 2}):
        out = compact(doc)
        assert size(out) <= RESULT_BOUND - ENVELOPE, size(out)
        assert out["ok"] == doc["ok"]
    assert compact(None) is None


@pytest.mark.parametrize("name", tool_names())
def test_every_tool_result_is_bounded_and_says_what_its_exit_code_means(name, monkeypatch):
    from flaloop.cli import agent

    huge = {"ok": True, "op": OP, "kind": name, "bench": _huge_record(300), "next": f"flaloop report {OP}",
            "items": [{"x": "y" * 500}] * 2000}

    async def fake_run(argv, report, cwd=None):
        return {"exit_code": 0, "meaning": agent_tools.meaning(argv[0], 0), "result": huge}

    monkeypatch.setattr(agent, "run_command", fake_run)
    spec = tool_specs([name])[0]
    args = {p.name: 1 if "int" in str(p.annotation) else "x" for p in spec.params if p.required}
    out = anyio.run(agent.call, spec, spec.model(), args, None)
    assert len(json.dumps(out, default=str).encode()) <= RESULT_BOUND
    assert out["meaning"].startswith("done") and out["result"]["ok"] is True
    if name not in ("status", "list", "bench", "verify", "report"):
        assert "verdict delivered" not in out["meaning"]  # a command that delivers no verdict says its own
    full = anyio.run(agent.call, spec, spec.model(), {**args, "detail": True}, None)
    assert full["result"] == huge


def test_a_result_without_a_document_keeps_the_last_lines_within_the_bound(monkeypatch):
    from flaloop.cli import agent

    async def fake_run(argv, report, cwd=None):
        return {"exit_code": 4, "meaning": agent_tools.meaning(argv[0], 4), "result": None,
                "stderr_tail": "\n".join(f"line {i} " + "x" * 300 for i in range(40))}

    monkeypatch.setattr(agent, "run_command", fake_run)
    spec = tool_specs(["list"])[0]
    out = anyio.run(agent.call, spec, spec.model(), {}, None)
    assert len(json.dumps(out).encode()) <= RESULT_BOUND and out["stderr_tail"].endswith("line 39 " + "x" * 300)
    assert out["meaning"] == "internal error of flaloop"
