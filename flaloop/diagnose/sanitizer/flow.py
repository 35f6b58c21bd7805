"""`flaloop sanitize OP`: one step of every contract cell under compute-sanitizer, base and candidate.

Each tool (memcheck, racecheck, initcheck, synccheck) runs one process per side:
`compute-sanitizer --tool T ... python -u inside/scripts/sanitize_step.py`, in a detached worktree of the
base commit and in the candidate (the working tree, or a worktree of `candidate_commit`), both
reading the base's registry as the bench does; before any tool, each side runs the same script
once plainly, so that compiling and autotuning happen at full speed (`warm_side`). The step
script prints `flaloop-cell <id>` before each cell, so every error record the tool prints on the
same stream belongs to the last cell named before it. Records are reduced to (cell, kind, kernel): addresses, thread and block
indices, access sizes and hazard counts are dropped, so that the same bug reads the same on both
sides. What only the candidate has is a blocking `sanitizer-<tool>` finding; what the base has
too is pre-existing and reported, not blocking.

Where compute-sanitizer is missing, or says it cannot run here (an unsupported device, no
permission), the tool is reported unavailable with the reason and nothing blocks. A CPU-only run
is not a refusal: compute-sanitizer then reports that the target made no CUDA call, which is
zero errors, and the document says the step ran on the CPU.

Results: `profile/<op>-opt/sanitize/<stamp>/sanitize.json` and per tool and side the raw log
(`<tool>-<side>.log`) and the step script's report (`<tool>-<side>.json`); the plain runs' are
`warm-<side>.log` and `warm-<side>.json`.

Three modules: reading the tool's output is flaloop/diagnose/sanitizer/log.py; finding compute-sanitizer and
running it on one side is flaloop/diagnose/sanitizer/run.py; this one picks the cells, runs the sides,
compares them, writes the document and judges a run record or a go by it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from flaloop.bench import model as model_mod
from flaloop.core import clock, fsutil, git
from flaloop.core.errors import UsageError
from flaloop.core.workspace import SANITIZE_FILE, Workspace
from flaloop.diagnose.profile import step_env
from flaloop.diagnose.sanitizer.log import STARTUP, ErrorRecord, compare
from flaloop.diagnose.sanitizer.run import (
    DEFAULT_TIMEOUT,
    PRINT_LIMIT,
    Running,
    SideRun,
    find_sanitizer,
    not_run,
    run_side,
    sanitizer_version,
    warm_side,
)
from flaloop.guard import catalogue
from flaloop.guard.findings import BLOCK, WARN, Finding, apply_allowances

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")


# -- the cells, the comparison, the document ----------------------------------------------------

def contract_cells(target, contract, only: list[str] | None = None) -> list[model_mod.Cell]:
    """Every cell of the contract (shapes x modes, and the varlen cells when it asks), as the bench
    builds them; `only` keeps the cells with these ids."""
    spec = target.contract_spec(contract)
    cells = model_mod.make_cells(target.shape_configs(spec), list(contract.shapes), list(contract.modes),
                                 model_mod.BenchConfig().dtype, bool(contract.varlen))
    if not cells:
        raise UsageError("no cells to sanitize: the contract has no shapes",
                         f"set shapes with `flaloop init {contract.op} --force --shapes ...`")
    if only:
        unknown = sorted(set(only) - {c.id for c in cells})
        if unknown:
            raise UsageError(f"unknown cell(s) {', '.join(unknown)}", f"the contract's: {', '.join(c.id for c in cells)}")
        cells = [c for c in cells if c.id in set(only)]
    return cells


def check_tools(tools: list[str] | tuple[str, ...]) -> list[str]:
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        raise UsageError(f"unknown compute-sanitizer tool(s) {', '.join(bad)}", f"choose from {', '.join(TOOLS)}")
    return list(dict.fromkeys(tools)) or list(TOOLS)


def findings_for(tool: str, new: list[ErrorRecord], base_cells: dict[str, dict],
                 base_unfinished: str | None = None) -> list[Finding]:
    """One finding per error only the candidate has (in the order printed): blocking, a racecheck
    warning only warns. CUDA API errors after a kernel's error are its consequence (a faulting kernel
    kills the context: every later call fails), counted into that kernel's finding.

    `base_unfinished` says why the base's run did not finish (a timeout, a failed step script): an
    error in a cell the base never reported on is then not said to be "never on the base". It still
    blocks: nothing shows that the base has it too, and the candidate's run did show it."""
    out: list[Finding] = []
    fallout = 0
    for r in new:
        if r.kernel is None and any(f.severity == BLOCK for f in out):
            fallout += r.count
            continue
        where = f" ({r.where})" if r.where else ""
        msg = f"{r.kind} in kernel {r.kernel}{where}" if r.kernel else r.kind
        base_cell = base_cells.get(r.cell) or {}
        if base_unfinished and not base_cell and not (r.cell == STARTUP and base_cells):
            msg += (f", {r.count}x on the candidate; the base was not checked there ({base_unfinished}), "
                    "so whether it has it too is unknown")
        else:
            msg += f", {r.count}x on the candidate, never on the base"
        if base_cell and not base_cell.get("ok"):
            msg += f" (the base's step of this cell failed: {base_cell.get('error')})"
        f = catalogue.finding(f"sanitizer-{tool}", msg, severity=WARN if r.severity == "warning" else BLOCK)
        out.append(dataclasses.replace(f, cell=r.cell, side="cand"))
    first = next((i for i, f in enumerate(out) if f.severity == BLOCK), None)
    if fallout and first is not None:
        f = out[first]
        out[first] = dataclasses.replace(f, message=f"{f.message}; then {fallout} failed CUDA API call(s) "
                                                    "(the context was dead)")
    return out


def tool_result(tool: str, base: SideRun, cand: SideRun | None) -> tuple[dict, list[Finding]]:
    """The tool's entry in the document, and its findings."""
    runs = [r for r in (base, cand) if r is not None]
    refused = next((r for r in runs if r.status == "refused"), None)
    entry: dict = {"sides": {r.side: r.to_dict() for r in runs}, "new": [], "pre_existing": [], "unchecked": []}
    if refused is not None or cand is None:
        entry.update(available=False, reason=(refused.reason if refused else "not run"))
        return entry, []
    new, old = compare(base.records, cand.records)
    entry.update(available=True, new=[r.to_dict() for r in new], pre_existing=[r.to_dict() for r in old])
    notes = [f"{r.side}: {r.reason}" for r in runs if r.reason]
    entry["reason"] = "; ".join(notes) or "ran on both sides"
    found = findings_for(tool, new, {c["id"]: c for c in base.cells if "id" in c},
                         base_unfinished=None if base.status == "ok" else f"{base.status}: {base.reason}")
    entry["unchecked"] = [] if any(f.severity == BLOCK for f in found) else cand_only_failures(base, cand)
    return entry, found


def cand_only_failures(base: SideRun, cand: SideRun) -> list[str]:
    """Cells whose step failed on the candidate but not on the base, with no error the tool saw: a
    fault outside what this tool watches (an illegal address under racecheck), or a dead context."""
    base_ok = {c["id"] for c in base.cells if c.get("ok")}
    return [f"{c['id']} failed on the candidate, not on the base: {c.get('error')}"
            for c in cand.cells if not c.get("ok") and c.get("id") in base_ok]


def unavailable(tools: list[str], reason: str) -> dict:
    return {t: {"available": False, "reason": reason, "sides": {}, "new": [], "pre_existing": [], "unchecked": []}
            for t in tools}


def cost(tools: dict, warm: dict) -> dict:
    """Where the time went: the plain warm-up per side, per tool and side, and per cell (setup +
    step under the tool)."""
    per_tool, per_cell = {}, {}
    for tool, entry in tools.items():
        for side, run in entry["sides"].items():
            per_tool.setdefault(tool, {})[side] = run["wall_s"]
            for c in run["cells"]:
                per_cell.setdefault(c["id"], {}).setdefault(tool, {})[side] = c.get("wall_s")
    return {"warm_s": {side: w["wall_s"] for side, w in warm.items()}, "per_tool_s": per_tool, "per_cell_s": per_cell}


@contextlib.contextmanager
def _candidate_tree(root: Path, commit: str | None) -> Iterator[Path]:
    if commit is None:
        yield root
        return
    with git.worktree(root, commit, "cand") as tree:
        yield tree


def sanitize(target, contract, *, candidate_commit: str | None = None, cells: list[str] | None = None,
             tools: list[str] | tuple[str, ...] = TOOLS, device: str | None = None,
             on_event: Callable[..., None] | None = None, timeout: float = DEFAULT_TIMEOUT,
             print_limit: int = PRINT_LIMIT, command: str = "", jobs: int = len(TOOLS)) -> dict:
    """Every contract cell under each tool on the base and on the candidate (the working tree, or
    `candidate_commit`); write and return sanitize.json's content ("blocked", "findings", "tools").
    Up to `jobs` tools run at once, each its base side then its candidate side."""
    say = on_event or (lambda *a, **k: None)
    tools = check_tools(tools)
    picked = contract_cells(target, contract, cells)
    if candidate_commit is not None:  # recorded as the commit, so a go finds this run by its kept commit
        candidate_commit = git.resolve_ref(target.root, candidate_commit)
    if target.contract_spec(contract).declared is None and not target.registry_file.is_file():
        raise UsageError(f"{contract.op} has no registry entry to build inputs from",
                         f"the bench reads TensorSpecs from {target.registry_file.relative_to(target.root)}")
    ws = target.workspace(contract.op)
    stamp = clock.now_stamp()
    out = fsutil.unique_dir(ws.sanitize, stamp)
    wire = [c.to_wire(model_mod.BenchConfig(inputs=dict(contract.input_overrides)), 1, "eager") for c in picked]
    cells_file = fsutil.atomic_write_json(out / "cells.json", wire)
    exe = find_sanitizer()
    doc: dict = {"kind": "sanitize", "schema": 1, "op": contract.op, "created": stamp, "command": command,
                 "base_commit": contract.base_commit,
                 "candidate": {"commit": candidate_commit} if candidate_commit else git.tree_state(target.root),
                 "cells": [c.id for c in picked], "sanitizer": {"path": exe}, "dir": str(out)}
    t0 = time.monotonic()
    findings: list[Finding] = []
    if exe is None:
        doc["tools"] = unavailable(tools, "compute-sanitizer is not on PATH, nor in $CUDA_HOME/bin or "
                                          "/usr/local/cuda/bin (it comes with the CUDA toolkit): nothing checked")
    else:
        doc["sanitizer"]["version"] = sanitizer_version(exe)
        doc["tools"] = {}
        env = step_env(ws)
        with git.worktree(target.root, contract.base_commit, "base") as base_tree, \
                _candidate_tree(target.root, candidate_commit) as cand_tree:
            registry = target.worker_registry(contract, base_tree, out)

            running = Running()
            trees = {"base": base_tree, "cand": cand_tree}
            doc["warm"] = {}
            for side, tree in trees.items():
                say("warm", side=side, cells=len(picked))
                doc["warm"][side] = warm_side(side, python=target.python, tree=tree, registry=registry,
                                              op=contract.op, cells_file=cells_file, out=out, env=env,
                                              device=device, timeout=timeout, running=running)

            def one_tool(tool: str) -> tuple[dict, list[Finding]]:
                runs: dict[str, SideRun] = {}
                for side, tree in trees.items():
                    if running.stopped:
                        raise KeyboardInterrupt
                    if doc["warm"][side]["status"] == "timeout":
                        runs[side] = not_run(tool, side, doc["warm"][side])
                        continue
                    say("run", side=side, tool=tool, cells=len(picked))
                    runs[side] = run_side(exe, tool, side, python=target.python, tree=tree, registry=registry,
                                          op=contract.op, cells_file=cells_file, out=out, env=env, device=device,
                                          timeout=timeout, print_limit=print_limit, running=running,
                                          on_cell=lambda cid, s=side, t=tool: say("cell", side=s, tool=t, cell=cid))
                    if runs[side].status == "refused":
                        break  # the device refuses this tool: the other side would too
                return tool_result(tool, runs["base"], runs.get("cand"))

            # The tools are separate processes that check and never time, so they can share the
            # device: up to `jobs` of them run at once (one alone runs on this thread).
            width = max(1, min(jobs, len(tools)))
            if width == 1:
                results = [one_tool(t) for t in tools]
            else:
                pool = concurrent.futures.ThreadPoolExecutor(width, thread_name_prefix="sanitize")
                try:
                    results = [f.result() for f in [pool.submit(one_tool, t) for t in tools]]
                except BaseException:
                    running.stop()  # an interrupt (or a crash): kill what runs, start nothing more
                    raise
                finally:
                    pool.shutdown(wait=True, cancel_futures=True)
            for tool, (entry, found) in zip(tools, results, strict=True):
                doc["tools"][tool] = entry
                findings += found
    findings = apply_allowances(findings, list(getattr(contract, "allowed", None) or []))
    doc["findings"] = [f.to_dict() for f in findings]
    doc["blocked"] = any(f.blocking for f in findings)
    doc["failed"] = [f"{t}/{s}: {r['reason']}" for t, e in doc["tools"].items() for s, r in e["sides"].items()
                     if r["status"] in ("failed", "timeout")]
    doc["failed"] += [f"{t}: {line}" for t, e in doc["tools"].items() for line in e.get("unchecked") or []]
    doc["wall_s"] = round(time.monotonic() - t0, 3)
    doc["cost"] = cost(doc["tools"], doc.get("warm") or {})
    doc["path"] = str(out / SANITIZE_FILE)
    fsutil.atomic_write_json(out / SANITIZE_FILE, doc)
    return doc


# -- a run record under the sanitizer's judgement (verify --sanitize, iter --sanitize) ----------

def attach(record, doc: dict) -> bool:
    """Put the sanitizer's findings into a bench run record, as the bench's own probes' are: a
    blocking one blocks the cell it names (a start-up or exit one, every cell) and the run.
    Returns whether it blocked anything."""
    found = [Finding.from_dict(f) for f in doc.get("findings") or []]
    if not found:
        return False
    ids = {c.cell.id for c in record.cells}
    record.guard.findings.extend(found)
    blocking = [f for f in found if f.blocking]
    for c in record.cells:
        mine = [f for f in blocking if f.cell == c.cell.id or f.cell not in ids]
        c.findings.extend(f for f in found if f.cell == c.cell.id)
        if mine and c.status == "ok" and c.verdict != "BLOCKED":
            rules = ", ".join(sorted({f.rule for f in mine}))
            c.reason = (c.reason + "; " if c.reason else "") + f"guard: {rules} (measured {c.verdict})"
            c.verdict = "BLOCKED"
    if blocking:
        record.guard.blocked = True
    record.summary.n_blocked = sum(c.verdict == "BLOCKED" for c in record.cells)
    return bool(blocking)


# -- before a go ---------------------------------------------------------------------------------

def latest(ws: Workspace, base_commit: str, cand_commit: str, cells: list[str], tools=TOOLS) -> dict | None:
    """The newest sanitize.json of this base and candidate commit that ran every tool on every cell."""
    found = None
    for p in ws.sanitize_docs():
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if doc.get("base_commit") == base_commit and (doc.get("candidate") or {}).get("commit") == cand_commit \
                and set(cells) <= set(doc.get("cells") or []) and set(tools) <= set(doc.get("tools") or {}):
            found = doc
    return found


def for_go(target, contract, iteration, *, on_event: Callable[..., None] | None = None, command: str = "") -> dict:
    """The sanitizer run a go rests on: every contract cell under all four tools, the base against the
    kept iteration's commit; the recorded one when there is one, else a new one."""
    cells = [c.id for c in contract_cells(target, contract, None)]
    have = latest(target.workspace(contract.op), contract.base_commit, iteration.commit, cells)
    return have or sanitize(target, contract, candidate_commit=iteration.commit, on_event=on_event, command=command)


def go_missing(doc: dict) -> list[tuple[str, str]]:
    """What the sanitizer run leaves missing for a go: its blocking findings, or cells that failed on
    the candidate alone. A tool that is missing or refused is said, not held against the go."""
    if doc.get("blocked"):
        return [("sanitizer", "; ".join(f"{f['rule']} {f.get('cell') or ''}: {f['message']}" for f in doc["findings"]
                                        if f.get("blocking")) + f" ({doc.get('path')})")]
    if doc.get("failed"):
        return [("sanitizer", "not every cell could be checked: " + "; ".join(doc["failed"]) + f" ({doc.get('path')})")]
    return []
