"""Runs inside the TARGET's interpreter, under compute-sanitizer: one step of every cell, once.
(flaloop also runs it once with no tool around it, first: that run compiles and autotunes.)

    compute-sanitizer --tool TOOL ... python -u sanitize_step.py --tree T --registry R --op OP
        --cells CELLS.json --out RESULT.json [--side base|cand] [--device cpu|cuda]

The inputs are built by flaloop's own bench worker (loaded by path, never `import flaloop`), as
profile_step.py does, so the checked call is the one the bench times: same registry, seed,
transforms and overrides; fwd under no_grad, fwdbwd as forward + backward(dO). Everything runs
slowly under the sanitizer, so each cell is set up with the least the worker allows (one warm-up
call, which compiles and autotunes; one input set; the eager timer, no CUDA graph, no k
calibration) and then stepped once.

Before a cell starts, the line `flaloop-cell <id>` goes to stdout, flushed: compute-sanitizer
prints its error records on the same stream as they happen, so the orchestrator attributes each
record to the last cell named before it. RESULT.json says, per cell, whether it ran and how long
its setup and its step took under the tool.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

from flaloop_worker_step import worker_server  # beside this script

MARKER = "flaloop-cell"
# the least setup the worker allows: one compile/autotune call, one input set, no graph, k fixed
LEAN_SETUP = {"warmup": 1, "n_sets": 1, "k": 1, "timer": "eager", "placements": 1}


def _mark(cell_id: str) -> None:
    sys.stderr.flush()
    sys.stdout.write(f"{MARKER} {cell_id}\n")
    sys.stdout.flush()


def _short(exc: BaseException) -> str:
    """The exception's first line (torch's CUDA errors add five lines of advice)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _sync(worker) -> None:
    if worker.device is not None and worker.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def step_cell(worker, wire: dict) -> dict:
    """Set one cell up (lean) and run its step once; the times include the sanitizer's overhead."""
    cid = str(wire["id"])
    _mark(cid)
    t0 = time.perf_counter()
    out = {"id": cid, "ok": False, "setup_s": None, "step_s": None}
    try:
        worker.handle("setup", {"cell": {**wire, **LEAN_SETUP}})
        _sync(worker)
        out["setup_s"] = time.perf_counter() - t0
        cell = worker.cells[cid]
        t1 = time.perf_counter()
        cell.call(cell.sets[0])
        _sync(worker)
        out["step_s"] = time.perf_counter() - t1
        out["ok"] = True
    except Exception as exc:  # noqa: BLE001 - a sanitizer error can kill the CUDA context: go on, say so
        out["error"] = _short(exc)
    finally:
        try:
            worker.handle("release", {"cell": cid})
        except Exception:  # noqa: BLE001 - a dead context cannot free; the next cell says so itself
            pass
    out["wall_s"] = time.perf_counter() - t0
    sys.stdout.flush()
    return out


def run(args) -> dict:
    worker = worker_server(args)
    hello = worker.handle("hello", {})
    cells = json.loads(Path(args.cells).read_text())
    results = [step_cell(worker, wire) for wire in cells]
    _mark("(exit)")  # what the tool prints from here on (teardown) belongs to no cell
    return {"hello": hello, "device": hello.get("device"), "cells": results}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", required=True)
    p.add_argument("--registry", required=True)
    p.add_argument("--op", required=True)
    p.add_argument("--cells", required=True, help="a JSON file: the cells as the bench sends them")
    p.add_argument("--out", required=True, help="where the result JSON goes")
    p.add_argument("--side", default="cand", choices=["base", "cand"])
    p.add_argument("--device", default=None, choices=["cuda", "cpu"])
    args = p.parse_args()
    t0 = time.perf_counter()
    try:
        result = {"ok": True, **run(args)}
    except BaseException as exc:  # noqa: BLE001 - the orchestrator shows it
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result["wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
