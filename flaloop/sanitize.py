"""`flaloop sanitize OP`: one step of every contract cell under compute-sanitizer, base and candidate.

Each tool (memcheck, racecheck, initcheck, synccheck) runs one process per side:
`compute-sanitizer --tool T ... python -u scripts/sanitize_step.py`, in a detached worktree of the
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
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from flaloop import fsutil, git, procs
from flaloop.bench import model as model_mod
from flaloop.bench.record import now_stamp
from flaloop.errors import UsageError
from flaloop.guard import catalogue
from flaloop.guard.findings import BLOCK, WARN, Finding, apply_allowances
from flaloop.profiling import CELL_MARKER, check_provenance, step_env

SCRIPT = Path(__file__).parent / "scripts" / "sanitize_step.py"
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
# Without PyTorch's caching allocator every tensor is its own cudaMalloc: an access past a tensor's
# end then leaves its allocation (memcheck sees it) and a reused block is not "initialized" by an
# earlier tensor's writes (initcheck sees it). Inside the allocator's pool both pass unseen.
TOOL_ENV = {"memcheck": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
            "initcheck": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}}
# memcheck sees an access only where it leaves every allocation. Without caching, tensors may still
# sit side by side (the driver packs small cudaMallocs): the likely reason a read 720 bytes past
# FLA's `beta` went unseen on the H200 (docs/BENCHMARKS.md, fourteenth session; to be confirmed by
# benchmarks/sanitizer_reach.py). `--padding` puts this many unallocated bytes after each
# allocation: a block-sized overrun (64 rows of 8 heads x 64 bf16 values is 64 KiB) falls into it.
MEMCHECK_PADDING = 1 << 20
ERROR_EXIT = 86             # compute-sanitizer's exit code when it found errors (--error-exitcode)
PRINT_LIMIT = 1000          # error records printed per run (the summary still counts them all)
DEFAULT_TIMEOUT = 3600.0    # seconds per process: every kernel runs instrumented
CUDA_DIRS = ("/usr/local/cuda/bin",)

MARKER = CELL_MARKER  # the step script names each cell before running it
STARTUP = "(start-up)"      # records before the first cell: imports, the worker's hello
# the step script names "(exit)" after the last cell: teardown belongs to no cell
PREFIX = "========="
NO_CUDA = "Target application terminated before first instrumented API call"
# what compute-sanitizer says when it cannot run here (matched lower-case, only without a summary)
REFUSALS = ("not supported", "internal sanitizer error", "failed to initialize", "unable to", "permission",
            "err_nvgpuctrperm", "could not be initialized", "no cuda-capable device", "insufficient")
_ERROR_HEAD = re.compile(r"^(Invalid |Uninitialized |Misaligned |Out-of-range |Illegal |Warp |Lane |"
                         r"Device Hardware|Hardware |Malloc|Free |Leaked |Program hit |Barrier error|"
                         r"(Error|Warning): Race reported)")
_SUMMARY = re.compile(r"^ERROR SUMMARY: ([\d,]+) errors?$")
_NOT_PRINTED = re.compile(r"^ERROR SUMMARY: ([\d,]+) errors? (?:were|was) not printed")
_RACE_SUMMARY = re.compile(r"^RACECHECK SUMMARY: [\d,]+ hazards? displayed \(([\d,]+) errors?, ([\d,]+) warnings?\)")
_RACE = re.compile(r"^(?:(Error|Warning): Race reported between|and) (\w+) access at (.+)$")


# -- reading compute-sanitizer's output (pure) --------------------------------------------------

@dataclass(frozen=True)
class ErrorRecord:
    """One kind of error in one kernel on one cell, as often as the tool printed it."""

    cell: str
    kind: str                 # e.g. "Invalid __global__ write (out of bounds)", sizes and addresses dropped
    kernel: str | None        # None for an error on a CUDA API call
    severity: str = "error"   # "warning": racecheck's hazards it deems possibly benign
    where: str | None = None  # source file:line, where the tool names one
    count: int = 1
    example: str = ""         # the first record's head and location, as printed

    @property
    def key(self) -> tuple:
        return (self.cell, self.severity, self.kind, self.kernel)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class SanitizerLog:
    """What one compute-sanitizer run printed, read back."""

    records: list[ErrorRecord] = field(default_factory=list)
    errors: int | None = None       # the tool's own count (ERROR / RACECHECK SUMMARY); None: no summary
    warnings: int = 0
    truncated: bool = False         # more errors than --print-limit printed
    no_cuda: bool = False           # the target made no CUDA call (a CPU-only run)
    problem: str | None = None      # a line saying the tool could not run


def parse_log(text: str) -> SanitizerLog:
    """Error records by cell, the summary, and whether the tool ran at all."""
    log = SanitizerLog()
    found: dict[tuple, ErrorRecord] = {}
    cell, cur = STARTUP, None

    def close() -> None:
        nonlocal cur
        if cur is not None:
            rec = _record(cell_of_cur, cur)
            old = found.get(rec.key)
            found[rec.key] = dataclasses.replace(old, count=old.count + 1) if old else rec
        cur = None

    cell_of_cur = cell
    for raw in text.splitlines():
        if raw.startswith(MARKER):
            close()
            cell = raw[len(MARKER):].strip()
            continue
        if not raw.startswith(PREFIX):
            continue  # the target's own output
        body = raw[len(PREFIX):]
        line = body.strip()
        if not line:
            close()  # an empty prefixed line ends a record
            continue
        if len(body) - len(body.lstrip()) > 1:
            if cur is not None:
                cur.append(line)  # a detail line of the record being read
            continue
        close()
        if _head(log, line):
            cur, cell_of_cur = [line], cell
    close()
    log.records = list(found.values())
    return log


def _head(log: SanitizerLog, line: str) -> bool:
    """Read a top-level line into `log`; True when it starts an error record."""
    if _NOT_PRINTED.match(line):
        log.truncated = True
    elif m := _SUMMARY.match(line):
        log.errors = int(m[1].replace(",", ""))
    elif m := _RACE_SUMMARY.match(line):
        log.errors, log.warnings = int(m[1].replace(",", "")), int(m[2].replace(",", ""))
    elif NO_CUDA in line:
        log.no_cuda = True
    elif _ERROR_HEAD.match(line):
        return True
    elif log.problem is None and (line.startswith(("Error", "Internal")) or
                                  any(w in line.lower() for w in REFUSALS)):
        log.problem = line
    return False


def _record(cell: str, lines: list[str]) -> ErrorRecord:
    """One printed record (its head and detail lines) as an ErrorRecord."""
    head = lines[0]
    race = _RACE.match(head)
    if race:
        others = sorted({m[2] for ln in lines[1:] if (m := _RACE.match(ln))})  # the tool's order may vary
        kernel, where = location(race[3])
        kind = f"Race reported between {race[2]} access and {' / '.join(others) or '?'} access"
        return ErrorRecord(cell, kind, kernel, "warning" if race[1] == "Warning" else "error", where,
                           example=head)
    at = next((ln[3:] for ln in lines[1:] if ln.startswith("at ")), None)
    kernel, where = location(at) if at else (None, None)
    kind = normalize_kind(head)
    why = next((m[1] for ln in lines[1:] if (m := re.search(r"is (out of bounds|misaligned)", ln))), None)
    if why:
        kind += f" ({why})"
    return ErrorRecord(cell, kind, kernel, "error", where, example=" / ".join(lines[:2]))


def normalize_kind(head: str) -> str:
    """An error head without what changes from one occurrence to the next (sizes, addresses, codes)."""
    s = re.sub(r" of size \d+ bytes?", "", head)
    s = re.sub(r"0x[0-9a-fA-F]+", "0x?", s)
    s = re.sub(r" \(error \d+\)", "", s)
    return re.sub(r"\s+", " ", s).strip().rstrip(".")


def location(text: str) -> tuple[str | None, str | None]:
    """(kernel, file:line) of an `at ...` clause, in both formats compute-sanitizer has printed:
    `kernel(int *)+0x70`, `kernel+0x110 in chunk.py:42` (2023 on) and `0x70 in file.cu:6:kernel(int *)`."""
    text = re.sub(r"\s*\[[\d,]+ hazards?\]$", "", text.strip())
    if re.match(r"0x[0-9a-fA-F]+\b", text):
        rest = text.split(" in ", 1)[1] if " in " in text else ""
        m = re.match(r"^(?P<file>[^:\s()]+):(?P<line>\d+):(?P<kernel>.+)$", rest)
        if m:
            return kernel_name(m["kernel"]), f"{m['file']}:{m['line']}"
        return kernel_name(rest), None
    head, _, where = text.partition(" in ")
    return kernel_name(head), where.strip() or None


def kernel_name(text: str) -> str | None:
    """A kernel's name without its offset and argument list."""
    s = re.sub(r"\+0x[0-9a-fA-F]+$", "", text.strip())
    return s.split("(", 1)[0].strip() or None


def compare(base: list[ErrorRecord], cand: list[ErrorRecord]) -> tuple[list[ErrorRecord], list[ErrorRecord]]:
    """(what only the candidate has, what the base has too), by (cell, severity, kind, kernel)."""
    seen = {r.key for r in base}
    return [r for r in cand if r.key not in seen], [r for r in cand if r.key in seen]


# -- finding and running compute-sanitizer -------------------------------------------------------

def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, else in $CUDA_HOME/bin or /usr/local/cuda/bin."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    dirs = [os.path.join(os.environ[v], "bin") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    for d in [*dirs, *CUDA_DIRS]:
        path = os.path.join(d, "compute-sanitizer")
        if os.access(path, os.X_OK):
            return path
    return None


@functools.lru_cache(maxsize=8)
def sanitizer_options(exe: str) -> frozenset[str]:
    """The long options this compute-sanitizer lists in `--help` (empty when it cannot say)."""
    try:
        proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(re.findall(r"^\s*(--[a-z][\w-]*)", proc.stdout, re.MULTILINE))


def tool_flags(exe: str, tool: str) -> list[str]:
    """What flaloop adds to compute-sanitizer's command line for `tool`, where this version has it."""
    if tool == "memcheck" and "--padding" in sanitizer_options(exe):
        return ["--padding", str(MEMCHECK_PADDING)]
    return []


def sanitizer_version(exe: str) -> str:
    try:
        proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    return next((ln for ln in lines if ln.startswith("Version")), lines[-1] if lines else "unknown")


@dataclass
class SideRun:
    """One side under one tool: how it went, what the tool printed, what the step script said."""

    side: str
    tool: str
    status: str = "ok"        # ok | refused | failed | timeout
    reason: str = ""
    exit_code: int | None = None
    wall_s: float = 0.0
    log: str = ""
    device: str | None = None
    instrumented: bool = True  # False: the target made no CUDA call (the CPU)
    errors: int | None = None  # the tool's own count
    warnings: int = 0
    truncated: bool = False
    records: list[ErrorRecord] = field(default_factory=list)
    cells: list[dict] = field(default_factory=list)  # per cell: ok, error, setup_s, step_s, wall_s
    flags: list[str] = field(default_factory=list)  # what flaloop added for this tool (tool_flags)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "records": [r.to_dict() for r in self.records]}


class Running:
    """The compute-sanitizer processes alive now, so that an interrupted run kills every one (those
    started from the pool's threads get no PDEATHSIG, see flaloop.procs) and starts no more."""

    def __init__(self) -> None:
        self.procs: set[subprocess.Popen] = set()
        self.stopped = False
        self._lock = threading.Lock()

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            if self.stopped:
                procs.kill_popen(proc)
            self.procs.add(proc)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self.procs.discard(proc)

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            alive = list(self.procs)
        for proc in alive:
            procs.kill_popen(proc)


def _run_logged(cmd: list[str], *, cwd: Path, env: dict, log: Path, timeout: float,
                on_line: Callable[[str], None], running: Running | None = None) -> tuple[int | None, bool]:
    """Run `cmd` with stdout and stderr, in order, into `log`; each line also to `on_line`.
    Returns (exit code, whether it was killed for taking longer than `timeout`)."""
    with open(log, "w", encoding="utf-8", errors="replace") as fh, \
            procs.spawn(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        errors="replace", bufsize=1) as proc:
        if running is not None:
            running.add(proc)

        def write(line: str) -> None:
            fh.write(line)
            on_line(line)

        try:
            timed_out = procs.follow(proc, proc.stdout, write, timeout)
        finally:
            if running is not None:
                running.discard(proc)
    return (None if timed_out else proc.returncode), timed_out


def step_command(python: str, tree: Path, registry: Path, op: str, cells_file: Path, result: Path, side: str,
                 device: str | None) -> list[str]:
    """The step script over every cell of `cells_file` on `tree`, its report written to `result`."""
    cmd = [python, "-u", str(SCRIPT), "--tree", str(tree), "--registry", str(registry), "--op", op,
           "--cells", str(cells_file), "--out", str(result), "--side", side]
    return cmd + ["--device", device] if device else cmd


def warm_side(side: str, *, python: str, tree: Path, registry: Path, op: str, cells_file: Path, out: Path,
              env: dict, device: str | None, timeout: float, running: Running | None = None) -> dict:
    """The step script once on `tree` with no tool around it, before any tool: what it compiled and
    tuned, the tools' runs then find in the Triton cache.

    Under a tool every kernel the compiler loads is instrumented and every autotuning trial runs
    slowly: on the H200 with a cold Triton cache, racecheck spent 147 s setting up one FLA cell that
    took 7 s once compiled, and a plant compiled under it outran `--timeout 240` on both sides
    (docs/BENCHMARKS.md, fifteenth session). The plain run compiles at full speed, and its
    autotuning picks (TRITON_CACHE_AUTOTUNING, shared with the bench) are timed on an
    uninstrumented device, not under a tool whose slowdown would make them the next bench's picks."""
    log, result = out / f"warm-{side}.log", out / f"warm-{side}.json"
    t0 = time.monotonic()
    code, timed_out = _run_logged(step_command(python, tree, registry, op, cells_file, result, side, device),
                                  cwd=tree, env=env, log=log, timeout=timeout, on_line=lambda _line: None,
                                  running=running)
    step = _read_step(result)
    check_provenance(step.get("hello"), tree, op, side, "sanitize")
    failed = [c for c in step.get("cells") or [] if not c.get("ok")]
    if timed_out:
        status, reason = "timeout", f"killed after {timeout:.0f}s (--timeout) with no tool around it"
    elif not step.get("ok"):
        status, reason = "failed", step_failure(step, result, code)
    elif failed:
        status, reason = "failed", f"{failed[0]['id']}: {failed[0].get('error')}"
    else:
        status, reason = "ok", ""
    return {"status": status, "reason": reason, "exit_code": code, "wall_s": round(time.monotonic() - t0, 3),
            "log": str(log), "device": step.get("device"),
            "cells": [{k: c.get(k) for k in ("id", "ok", "setup_s", "wall_s")} for c in step.get("cells") or []]}


def step_failure(step: dict, result: Path, code: int | None) -> str:
    """Why a step script's run (its report `step`, read from `result`) failed as a whole."""
    return f"the step script failed: {step.get('error') or f'no {result.name} (exit {code})'}"


def not_run(tool: str, side: str, warm: dict) -> SideRun:
    """A side whose plain warm-up run timed out: under the tool it would only hang longer."""
    return SideRun(side, tool, status="timeout", log=warm["log"],
                   reason=f"not run: the plain warm-up run was {warm['reason']}")


def run_side(exe: str, tool: str, side: str, *, python: str, tree: Path, registry: Path, op: str,
             cells_file: Path, out: Path, env: dict, device: str | None, timeout: float,
             print_limit: int = PRINT_LIMIT, on_cell: Callable[[str], None] | None = None,
             running: Running | None = None) -> SideRun:
    """One compute-sanitizer process: `tool` over every cell of `cells_file`, on `tree`."""
    log, result = out / f"{tool}-{side}.log", out / f"{tool}-{side}.json"
    flags = tool_flags(exe, tool)
    cmd = [exe, "--tool", tool, "--print-limit", str(print_limit), "--error-exitcode", str(ERROR_EXIT),
           "--target-processes", "application-only", *flags,
           *step_command(python, tree, registry, op, cells_file, result, side, device)]

    def on_line(line: str) -> None:
        if on_cell and line.startswith(MARKER):
            on_cell(line[len(MARKER):].strip())

    t0 = time.monotonic()
    code, timed_out = _run_logged(cmd, cwd=tree, env={**env, **TOOL_ENV.get(tool, {})}, log=log,
                                  timeout=timeout, on_line=on_line, running=running)
    run = SideRun(side, tool, exit_code=code, wall_s=round(time.monotonic() - t0, 3), log=str(log), flags=flags)
    parsed = parse_log(log.read_text(encoding="utf-8", errors="replace"))
    run.errors, run.warnings, run.truncated = parsed.errors, parsed.warnings, parsed.truncated
    run.records, run.instrumented = parsed.records, not parsed.no_cuda
    step = _read_step(result)
    run.device, run.cells = step.get("device"), step.get("cells") or []
    check_provenance(step.get("hello"), tree, op, side, "sanitize")
    ran = parsed.errors is not None or parsed.no_cuda
    if timed_out:
        run.status, run.reason = "timeout", f"killed after {timeout:.0f}s (--timeout)"
    elif not ran and parsed.problem:
        run.status, run.reason = "refused", f"compute-sanitizer could not run: {parsed.problem}"
    elif not ran:
        run.status, run.reason = "failed", f"compute-sanitizer printed no summary (exit {code}); see {log.name}"
    elif not step.get("ok"):
        run.status = "failed"
        run.reason = step_failure(step, result, code)
    elif parsed.no_cuda:
        run.reason = f"the step ran on {run.device or 'the CPU'}: no CUDA call, nothing for {tool} to check"
    return run


def _read_step(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# -- the cells, the comparison, the document ----------------------------------------------------

def contract_cells(target, contract, only: list[str] | None = None) -> list[model_mod.Cell]:
    """Every cell of the contract (shapes x modes, and the varlen cells when it asks), as the bench
    builds them; `only` keeps the cells with these ids."""
    spec = target.op(contract.op)
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
    if not target.registry_file.is_file():
        raise UsageError(f"{contract.op} has no registry entry to build inputs from",
                         f"the bench reads TensorSpecs from {target.registry_file.relative_to(target.root)}")
    ws = target.workspace(contract.op)
    stamp = now_stamp()
    out = fsutil.unique_dir(ws / "sanitize", stamp)
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
        registry_rel = target.registry_file.relative_to(target.root)
        env = step_env(ws)
        with git.worktree(target.root, contract.base_commit, "base") as base_tree, \
                _candidate_tree(target.root, candidate_commit) as cand_tree:
            registry = base_tree / registry_rel  # both sides read the base's registry, as the bench does

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
    doc["path"] = str(out / "sanitize.json")
    fsutil.atomic_write_json(out / "sanitize.json", doc)
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

def latest(ws: Path, base_commit: str, cand_commit: str, cells: list[str], tools=TOOLS) -> dict | None:
    """The newest sanitize.json of this base and candidate commit that ran every tool on every cell."""
    found = None
    for p in sorted((ws / "sanitize").glob("*/sanitize.json")):
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
