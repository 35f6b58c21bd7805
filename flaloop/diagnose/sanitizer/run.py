"""Finding and running compute-sanitizer: one process per tool and side over the step script
(inside/scripts/sanitize_step.py), the plain warm-up run before the tools, and what each run showed
(`SideRun`). flaloop/diagnose/sanitizer/flow.py decides what it means."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flaloop import inside
from flaloop.core import procs
from flaloop.diagnose.profile import check_provenance
from flaloop.diagnose.sanitizer.log import MARKER, ErrorRecord, parse_log

SCRIPT = inside.script("sanitize_step.py")
# Without PyTorch's caching allocator every tensor is its own cudaMalloc: an access past a tensor's
# end then leaves its allocation (memcheck sees it) and a reused block is not "initialized" by an
# earlier tensor's writes (initcheck sees it). Inside the allocator's pool both pass unseen.
TOOL_ENV = {"memcheck": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
            "initcheck": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}}
# memcheck sees an access only where it leaves every allocation. Without caching, tensors may still
# sit side by side (the driver packs small cudaMallocs): the likely reason a read 720 bytes past
# FLA's `beta` went unseen on the H200 (docs/lab/2026-12-01-h200.md, R14; to be confirmed by
# benchmarks/sanitizer_reach.py). `--padding` puts this many unallocated bytes after each
# allocation: a block-sized overrun (64 rows of 8 heads x 64 bf16 values is 64 KiB) falls into it.
MEMCHECK_PADDING = 1 << 20
ERROR_EXIT = 86             # compute-sanitizer's exit code when it found errors (--error-exitcode)
PRINT_LIMIT = 1000          # error records printed per run (the summary still counts them all)
DEFAULT_TIMEOUT = 3600.0    # seconds per process: every kernel runs instrumented
CUDA_DIRS = ("/usr/local/cuda/bin",)


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
    started from the pool's threads get no PDEATHSIG, see flaloop.core.procs) and starts no more."""

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
    (docs/lab/2026-12-01-h200.md, R15). The plain run compiles at full speed, and its
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
