"""flaloop's commands as MCP tools, without the MCP SDK: which commands are tools, their parameters
(read from the commands' typer declarations, named as the CLI's long options), the check of a
call's arguments (answered as the CLI answers a usage error), and the compact result an agent reads.

Every command the app registers is a tool unless `EXCLUDED` names it with a reason, so a command
added to the CLI is a tool with no change here. A parameter's name is its option's long spelling
with underscores (`--target` -> `target`, `--input` -> `input`, `-k` -> `k`); a positional argument
keeps its own name (`op`, `direction`).

A result is bounded (`RESULT_BOUND` bytes of JSON): a run record becomes its table (one row a cell:
verdict, speedup, interval), its geomean, its guard's blocking findings and its path; anything else
is cut to its scalars and the heads of its lists until it fits. `detail: true` returns the command's
whole document.
"""

from __future__ import annotations

import difflib
import enum
import inspect
import json
from dataclasses import dataclass
from typing import Any

from flaloop.cli import load_commands
from flaloop.cli.app import COMMAND_ORDER, app

# Commands that are no tool, and why (tests/unit/test_mcp.py checks every command is one or the other).
EXCLUDED = {
    "mcp": "it is this server: a tool would start another server inside it",
    "demo": "a guided tour for a person at a terminal, on a scratch copy of the bundled example",
    "skill": "installs SKILL.md into the agent's own configuration: run once from a shell, not per task",
}
NOT_TOOL_PARAMS = {"as_json", "ctx"}  # --json is always given; typer's Context is not an option
ARG_HELP = {"op": "The op's name (the `list` tool names them)."}
DETAIL = "detail"  # the tools' own parameter: the command's whole --json document
DETAIL_HELP = ("Return the command's whole --json document (a run record can be ~100 KB) instead of the "
               "compact result.")
RESULT_BOUND = 8192  # bytes of a compact result's JSON, with its envelope

# The README's exit-code table, short; a command's own words for 0 and 1 where they differ.
EXIT_MEANINGS = {
    0: "done",
    1: "a rule refused: gate red, a guard finding blocks, outputs differ from the base, a loop rule or a "
       "report refused",
    2: "usage or setup error: read `hint` in the result",
    3: "measurement failed: a worker crashed or hung, or no cell could be measured",
    4: "internal error of flaloop",
    130: "interrupted: workers, pytest and worktrees were cleaned up",
}
MEANING_0 = {
    "list": "done: the target's ops listed", "init": "done: the task contract written",
    "gate": "done: the gate is green", "audit": "done: the static audit blocks nothing",
    "baseline": "done: the baseline recorded", "iter": "done: the iteration delivered a status (keep, revert, "
    "noise or signal: read result.iteration.status)",
    "status": "done: where the loop stands", "log": "done: OPT_LOG.md is as the records say",
    "header": "done: the header rendered", "trap": "done: the trap recorded",
    "reassess": "done: the re-assessment recorded, the stall counter reset",
    "dispatch": "done: the dispatch row written (or listed)", "stop": "done: the stop decision recorded",
    "bench": "done: verdict delivered", "verify": "done: gate green, verdict delivered",
    "compare": "done: the records compared", "sweep": "done: candidates ranked",
    "profile": "done: profiled", "explain": "done: the win is explained by its kernels",
    "sanitize": "done: compute-sanitizer found nothing only the candidate has",
    "report": "done: the report rendered, its claim stands", "clean": "done: cleaned",
}
MEANING_1 = {
    "gate": "gate red", "audit": "the static audit blocks the change",
    "iter": "the iteration was dropped (gate red or guard blocked), or the loop refuses (stalled, cap)",
    "stop": "a stop bar is not met: read result.missing", "log": "OPT_LOG.md has hand edits",
    "report": "the report refuses its claim: read result.refused",
    "explain": "the kernels do not account for the measured win",
    "sanitize": "compute-sanitizer found an error only the candidate has",
}
# after these the loop's own next step (`status`'s `next`) is looked up
LOOP_COMMANDS = {"init", "baseline", "iter", "reassess", "stop", "trap", "dispatch"}


def meaning(command: str, code: int) -> str:
    table = {0: MEANING_0, 1: MEANING_1}.get(code, {})
    return table.get(command) or EXIT_MEANINGS.get(code, f"exit {code}")


# -- the tools: flaloop's commands as declared for typer ----------------------------------------

@dataclass(frozen=True)
class Param:
    name: str  # the tool's parameter: the long option with underscores, or the argument's name
    py_name: str  # the command's Python parameter
    annotation: Any
    flag: str | None  # None: a positional argument
    off_flag: str | None  # a boolean option's --no-... spelling
    default: Any
    required: bool
    help: str


@dataclass(frozen=True)
class ToolSpec:
    """One command as a tool: its parameters are the command's, read from its declaration."""

    name: str
    description: str
    params: tuple[Param, ...]

    def argv(self, values: dict[str, Any]) -> list[str]:
        """The command line for these parameter values (only those given: the CLI applies its defaults)."""
        options: list[str] = []
        positional: list[str] = []
        for p in self.params:
            value = values.get(p.name)
            if value is None:
                continue
            items = value if isinstance(value, list) else [value]
            if p.flag is None:
                positional += [_text(v) for v in items]
            elif isinstance(value, bool):
                options += [p.flag] if value else ([p.off_flag] if p.off_flag else [])
            else:
                for v in items:
                    options += [p.flag, _text(v)]
        end = ["--"] if any(a.startswith("-") for a in positional) else []
        return [self.name, *options, "--json", *end, *positional]

    def model(self):
        """The pydantic model of the tool's arguments: its JSON schema, and the check of a call."""
        import pydantic

        fields = {p.name: (p.annotation, pydantic.Field(... if p.required else p.default, description=p.help or None))
                  for p in self.params}
        fields[DETAIL] = (bool, pydantic.Field(False, description=DETAIL_HELP))
        return pydantic.create_model(f"flaloop_{self.name}", __config__=pydantic.ConfigDict(extra="forbid"),
                                     **fields)

    def check(self, model, arguments: dict) -> tuple[dict | None, dict | None]:
        """(values given, None), or (None, the CLI's usage-error document: one sentence, a hint)."""
        import pydantic

        names = [p.name for p in self.params] + [DETAIL]
        unknown = [k for k in arguments if k not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=3, cutoff=0.5)
            hint = (f"did you mean {' or '.join(close)}? " if close else "") + \
                f"the parameters of {self.name}: {', '.join(names)}"
            return None, usage_error(f"{self.name} has no parameter {unknown[0]!r}", hint)
        lists = {p.name for p in self.params if "list[" in str(p.annotation)}
        # one value where a list goes is a list of one, as on the command line (`shapes: "A,B"` too)
        arguments = {k: [v] if k in lists and isinstance(v, str) else v for k, v in arguments.items()}
        try:
            values = model.model_validate(arguments)
        except pydantic.ValidationError as exc:
            e = exc.errors()[0]
            where = ".".join(str(x) for x in e.get("loc") or ()) or "the arguments"
            if e.get("type") == "missing":
                return None, usage_error(f"{self.name} needs the parameter {where!r}",
                                         f"the required parameters: {', '.join(p.name for p in self.params if p.required)}")
            param = next((p for p in self.params if p.name == where.split(".")[0]), None)
            return None, usage_error(f"bad value {e.get('input')!r} for {where} of {self.name}: {e.get('msg', '')}",
                                     f"{where}: {param.help if param and param.help else 'see the input schema'}")
        return {name: getattr(values, name) for name in values.model_fields_set}, None


def usage_error(message: str, hint: str) -> dict:
    return {"ok": False, "error": message, "hint": hint, "exit_code": 2}


def _text(value: Any) -> str:
    return str(value.value if isinstance(value, enum.Enum) else value)


def _registered() -> dict:
    load_commands()  # the tools are every command, not only those of the line that started flaloop
    return {ci.name or ci.callback.__name__: ci for ci in app.registered_commands}


def tool_names() -> list[str]:
    """Every registered command not in EXCLUDED: the loop's order first (app.COMMAND_ORDER), then the rest."""
    names = [n for n in _registered() if n not in EXCLUDED]
    return sorted(names, key=lambda n: (COMMAND_ORDER.index(n) if n in COMMAND_ORDER else len(COMMAND_ORDER), n))


def param_name(py_name: str, flag: str | None) -> str:
    """The tool's name of a parameter: the long option as typed, with underscores; an argument's own name."""
    return py_name if flag is None else flag.lstrip("-").replace("-", "_")


def tool_specs(names: list[str] | None = None) -> list[ToolSpec]:
    """The commands `names` (default: every tool) as tools, in that order, each from its typer declaration."""
    from typer.models import ArgumentInfo, OptionInfo
    from typer.utils import get_params_from_function

    registered = _registered()
    specs = []
    for name in names or tool_names():
        ci = registered[name]
        params = []
        for pname, meta in get_params_from_function(ci.callback).items():
            if pname in NOT_TOOL_PARAMS:
                continue
            info = meta.default
            if isinstance(info, OptionInfo | ArgumentInfo):
                default, help_ = info.default, info.help or ""
            else:
                default, help_ = meta.default, ""
            required = default is ... or default is inspect.Parameter.empty
            flag = off = None
            if isinstance(info, OptionInfo):
                decl = next((d for d in info.param_decls if d.startswith("--")), info.param_decls[0])
                flag, _, off = decl.partition("/")
                off = off or None
            tool_name = param_name(pname, flag)
            if any(p.name == tool_name for p in params):
                continue  # another spelling of a parameter the tool has (verify's FLA-style --op)
            params.append(Param(tool_name, pname, meta.annotation, flag, off,
                                None if required else default, required, help_ or ARG_HELP.get(pname, "")))
        doc = inspect.cleandoc(ci.help or ci.callback.__doc__ or "").split("\n\nExamples:")[0]
        specs.append(ToolSpec(name, f"`flaloop {name}`: {doc}", tuple(params)))
    return specs


# -- the compact result -------------------------------------------------------------------------

def _is_run_record(x: Any) -> bool:
    return isinstance(x, dict) and isinstance(x.get("cells"), list) and "config" in x and "candidate" in x


def _num(x: Any) -> Any:
    return round(x, 4) if isinstance(x, float) else x


def record_table(rec: dict) -> dict:
    """A run record as an agent decides on it: one row a cell, the geomean, what blocks, the path."""
    rows = []
    for c in rec.get("cells") or []:
        cell, est = c.get("cell") or {}, c.get("estimate") or {}
        row = {"cell": (f"{cell.get('shape_name')}/{cell.get('mode')}" if cell.get("shape_name") else c.get("id"))
               if cell else c.get("id"), "status": c.get("status"), "verdict": c.get("verdict"),
               "speedup": _num(est.get("speedup")), "ci": [_num(est.get("ci_low")), _num(est.get("ci_high"))]
               if est else None}
        if c.get("reason"):
            row["reason"] = str(c["reason"])[:200]
        rows.append(row)
    guard = rec.get("guard") or {}
    findings = [{k: f.get(k) for k in ("rule", "cell", "blocking") if f.get(k) is not None}
                | {"message": str(f.get("message", ""))[:200]} for f in guard.get("findings") or []]
    summary = rec.get("summary") or {}
    geo = summary.get("geomean") or {}
    return {"record": rec.get("path"), "aa": (rec.get("config") or {}).get("aa"),
            "base": (rec.get("base") or {}).get("commit"), "candidate": (rec.get("candidate") or {}).get("commit"),
            "geomean": {k: _num(geo.get(k)) for k in ("speedup", "ci_low", "ci_high")} if geo else None,
            "counts": {k: v for k, v in summary.items() if k.startswith("n_")},
            "cells": rows, "blocked": guard.get("blocked"),
            "findings": sorted(findings, key=lambda f: not f.get("blocking"))[:12],
            "unverified": rec.get("unverified"), "interrupted": rec.get("interrupted"),
            "errors": [str(e)[:200] for e in rec.get("errors") or []][:5]}


REPORT_KEYS = ("ok", "exit_code", "op", "kind", "claim_ok", "conclusion", "refused", "summary", "records", "risks",
               "files", "commits")
REPORT_CELL_KEYS = ("id", "status", "verdict", "speedup", "ci_low", "ci_high", "reason")


def report_summary(doc: dict) -> dict:
    """`report`'s document as an agent reads it: the claim, its refusals, the table, where the files are."""
    out = {k: doc[k] for k in REPORT_KEYS if k in doc}
    out["cells"] = [{k: _num(c.get(k)) for k in REPORT_CELL_KEYS if c.get(k) not in (None, "")}
                    for c in doc.get("cells") or []]
    gate = (doc.get("test_plan") or {}).get("gate")
    out["gate"] = {k: gate.get(k) for k in ("green", "signal_only")} if isinstance(gate, dict) else None
    return out


def _summarize(x: Any) -> Any:
    if isinstance(x, dict) and x.get("kind") == "report" and isinstance(x.get("cells"), list) and "claim" in x:
        return report_summary(x)
    if _is_run_record(x):
        return {k: x[k] for k in ("ok", "exit_code") if k in x} | record_table(x)
    if isinstance(x, dict):
        return {k: _summarize(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_summarize(v) for v in x]
    return x


def _trim(x: Any, items: int, chars: int, depth: int) -> Any:
    if isinstance(x, str):
        return x if len(x) <= chars else x[:chars] + f"... ({len(x)} chars)"
    if isinstance(x, float):
        return _num(x)
    if isinstance(x, dict):
        if depth <= 0:
            return f"({len(x)} keys: detail=true)"
        return {k: _trim(v, items, chars, depth - 1) for k, v in x.items()}
    if isinstance(x, list):
        if depth <= 0:
            return f"({len(x)} items: detail=true)"
        head = [_trim(v, items, chars, depth - 1) for v in x[:items]]
        return head + ([f"... {len(x) - items} more (detail=true)"] if len(x) > items else [])
    return x


# (list items, string length, depth) from the gentlest cut on
# (strings stay readable: a path is never cut; lists and nesting go first)
CUTS = ((50, 600, 8), (20, 400, 6), (10, 300, 5), (6, 300, 4), (3, 240, 4), (3, 240, 3), (2, 200, 2), (1, 200, 1))
KEEP = ("ok", "error", "hint", "exit_code", "kind", "op", "record", "path", "next", "claim_ok", "conclusion")


def size(doc: Any) -> int:
    return len(json.dumps(doc, default=str).encode())


ENVELOPE = 1024  # the bytes a result's envelope (exit code, meaning, next) may take of RESULT_BOUND


def compact(doc: dict | None, budget: int = RESULT_BOUND - ENVELOPE) -> dict | None:
    """The command's document cut to `budget` bytes of JSON: run records as their tables, then
    strings, lists and nesting shortened, the gentlest cut that fits."""
    if doc is None:
        return None
    doc = _summarize(json.loads(json.dumps(doc, default=str)))
    if size(doc) <= budget:
        return doc
    for items, chars, depth in CUTS:
        out = _trim(doc, items, chars, depth)
        if size(out) <= budget:
            return out | {"cut": "shortened to fit; detail=true returns the whole document"}
    return {k: _trim(doc[k], 1, 200, 1) for k in KEEP if k in doc} | {
        "cut": "only the verdict's keys fit; detail=true returns the whole document"}
