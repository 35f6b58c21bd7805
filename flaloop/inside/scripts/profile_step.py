"""Runs inside the TARGET's interpreter, as a script: one step of one bench cell, profiled.

    python profile_step.py --tree T --registry R --op OP (--cell CELL_JSON | --cells CELLS_JSON) --out DIR
                           [--device cpu|cuda] [--side base|cand] [--steps N] [--ncu-target]

The inputs are built by flaloop's own bench worker (loaded by path, never `import flaloop`), so
the profiled step is exactly the call the bench times: same registry, seed, transforms and
overrides; fwd under no_grad, fwdbwd as forward + backward(dO). The cell is warmed up first
(compile, autotune). Then:

- default: three unprofiled steps give the host wall time of a step; one step runs under
  torch.profiler inside a `flaloop_step` range; the Chrome/Perfetto trace goes to
  DIR/trace-<side>.json and a kernel table (GPU kernels, or CPU ops without a GPU) to
  DIR/step-<side>.json;
- --ncu-target: one step inside the NVTX range `flaloop_step` and nothing else, for
  `ncu --nvtx --nvtx-include flaloop_step/`;
- --cells: a list of cells, each set up, profiled over --steps steps (kernel times and launches
  are per step: the totals over the steps divided by N, with each step's total beside them) and
  released in turn, all in one process; the result is DIR/cells-<side>.json (`flaloop explain`).

Without a GPU the "kernels" are what the host runs: each Triton kernel the interpreter executes
(TRITON_INTERPRET=1; its launches are wrapped in a `triton:<name>` range), the profiler's
top-level CPU operators, and the step's host time outside any of them as its own row, since on
the CPU the host's time is the device's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from flaloop_worker_step import worker_server  # beside this script

HOST_ROW = "(host time outside any op)"
STEP = "flaloop_step"


def _worker(args):
    worker = worker_server(args)
    return worker, worker.handle("hello", {})


def _setup(worker, cell_spec: dict):
    setup = worker.handle("setup", {"cell": cell_spec})
    return worker.cells[str(cell_spec["id"])], setup


def _build(args):
    worker, hello = _worker(args)
    cell, setup = _setup(worker, json.loads(args.cell))
    import torch

    return torch, worker, cell, hello, setup


def _name_interpreted_kernels() -> None:
    """Under TRITON_INTERPRET=1 each kernel launch becomes a profiler range `triton:<name>`, so the
    CPU profile shows the kernels (the interpreter's numpy work is otherwise invisible to it)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    from torch.profiler import record_function

    run = InterpretedFunction.run
    if getattr(run, "_flaloop_named", False):
        return

    def named(self, *args, **kwargs):
        with record_function(f"triton:{getattr(self.fn, '__name__', 'kernel')}"):
            return run(self, *args, **kwargs)

    named._flaloop_named = True
    InterpretedFunction.run = named


def _sync(torch, cell) -> None:
    if cell.is_cuda:
        torch.cuda.synchronize()


def _kernels_from_trace(trace_path: Path, cuda: bool) -> list[dict]:
    """GPU kernels (and memcpy/memset) of the trace, by name: total ms and launches."""
    data = json.loads(trace_path.read_text())
    by: dict[str, dict] = {}
    cats = ("kernel", "gpu_memcpy", "gpu_memset") if cuda else ()
    for ev in data.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in cats:
            continue
        k = by.setdefault(ev["name"], {"name": ev["name"], "total_ms": 0.0, "launches": 0, "cat": ev["cat"]})
        k["total_ms"] += float(ev.get("dur", 0.0)) / 1e3
        k["launches"] += 1
    return sorted(by.values(), key=lambda k: -k["total_ms"])


def _cpu_ops(prof) -> list[dict]:
    """Without a GPU the 'kernels' are the profiler's CPU ops, by self time."""
    out = []
    for e in prof.key_averages():
        self_us = float(getattr(e, "self_cpu_time_total", 0.0) or 0.0)
        if self_us <= 0 or e.key == STEP:
            continue
        out.append({"name": e.key, "total_ms": self_us / 1e3, "launches": int(e.count), "cat": "cpu_op"})
    return sorted(out, key=lambda k: -k["total_ms"])


def _cpu_top_level(prof) -> tuple[dict[str, dict], list[float]]:
    """The host's 'kernels': each operator or `triton:` range directly under a step range, by its
    total time, and each step's length; plus the host time of the steps outside all of them."""
    by: dict[str, dict] = {}
    steps: list[float] = []
    outside = 0.0
    for e in prof.events():
        if e.name != STEP:
            continue
        length = float(e.cpu_time_total) / 1e3
        steps.append(length)
        inner = 0.0
        for child in e.cpu_children:
            ms = float(child.cpu_time_total) / 1e3
            k = by.setdefault(child.name, {"name": child.name, "total_ms": 0.0, "launches": 0,
                                           "cat": "triton_interp" if child.name.startswith("triton:") else "cpu_op"})
            k["total_ms"] += ms
            k["launches"] += 1
            inner += ms
        outside += max(0.0, length - inner)
    by[HOST_ROW] = {"name": HOST_ROW, "total_ms": outside, "launches": 0, "cat": "host"}
    return by, steps


def _gpu_steps(trace_path: Path) -> tuple[dict[str, dict], list[float]]:
    """Kernels of a trace of several steps, and each step's kernel total (kernels that start inside
    a step range's time span, user annotations being on the host's timeline)."""
    data = json.loads(trace_path.read_text())
    events = [ev for ev in data.get("traceEvents", []) if ev.get("ph") == "X"]
    spans = sorted((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)))
                   for ev in events if ev.get("name") == STEP and ev.get("cat") == "gpu_user_annotation")
    by: dict[str, dict] = {}
    totals = [0.0] * len(spans)
    for ev in events:
        if ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ms = float(ev.get("dur", 0.0)) / 1e3
        k = by.setdefault(ev["name"], {"name": ev["name"], "total_ms": 0.0, "launches": 0, "cat": ev["cat"]})
        k["total_ms"] += ms
        k["launches"] += 1
        ts = float(ev["ts"])
        for i, (a, b) in enumerate(spans):
            if a <= ts <= b:
                totals[i] += ms
                break
    return by, totals


def profile_cells(args) -> dict:
    """Each cell of --cells: set up, warmed, --steps steps under the profiler, released."""
    _name_interpreted_kernels()
    worker, hello = _worker(args)
    import torch
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as tprofile

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = max(1, args.steps)
    cells = {}
    for spec in json.loads(args.cells):
        print(f"flaloop-cell {spec['id']}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        cell, setup = _setup(worker, spec)
        t1 = time.perf_counter()
        s = cell.sets[0]
        for _ in range(2):  # warm: compiled, tuned, allocator settled
            cell.call(s)
        _sync(torch, cell)
        t2 = time.perf_counter()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cell.is_cuda else [])
        cold = spec.get("l2") == "cold"  # as the bench timed it: each step after a cache flush, outside the step
        with tprofile(activities=activities) as prof:
            for _ in range(n):
                if cold:
                    worker.flush_l2()
                    _sync(torch, cell)
                with record_function(STEP):
                    cell.call(s)
                    _sync(torch, cell)
        t3 = time.perf_counter()
        if cell.is_cuda:
            trace = out / f"trace-{args.side}-{len(cells)}.json"
            prof.export_chrome_trace(str(trace))
            by, step_totals = _gpu_steps(trace)
            trace.unlink()  # the kernel table is kept; a trace per cell would be hundreds of MB
        else:
            by, step_totals = _cpu_top_level(prof)
        kernels = sorted(({**k, "ms": k["total_ms"] / n, "launches": k["launches"] / n} for k in by.values()),
                         key=lambda k: -k["ms"])
        for k in kernels:
            del k["total_ms"]
        cells[str(spec["id"])] = {"kernels": kernels, "steps": n, "step_ms": step_totals,
                                  "device_ms": sum(k["ms"] for k in kernels),
                                  "launches": sum(k["launches"] for k in kernels),
                                  "timer": (setup or {}).get("timer"),
                                  # where this cell's time went (a slow explain says which part)
                                  "wall_s": {"setup": round(t1 - t0, 3), "warm": round(t2 - t1, 3),
                                             "profiled": round(t3 - t2, 3), "trace": round(time.perf_counter() - t3, 3),
                                             "tuning_in_setup": bool((setup or {}).get("tuning"))}}
        worker.handle("release", {"cell": spec["id"]})
    return {"hello": hello, "device": hello.get("device"), "cells": cells}


def profile(args) -> dict:
    torch, worker, cell, hello, setup = _build(args)
    s = cell.sets[0]
    walls = []
    for _ in range(3):
        _sync(torch, cell)
        t0 = time.perf_counter()
        cell.call(s)
        _sync(torch, cell)
        walls.append((time.perf_counter() - t0) * 1e3)
    if args.ncu_target:
        torch.cuda.nvtx.range_push("flaloop_step")
        cell.call(s)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        return {"hello": hello, "ncu_target": True}
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as tprofile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cell.is_cuda else [])
    with tprofile(activities=activities, record_shapes=True) as prof:
        with record_function("flaloop_step"):
            cell.call(s)
            _sync(torch, cell)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"trace-{args.side}.json"
    prof.export_chrome_trace(str(trace))
    kernels = _kernels_from_trace(trace, True) if cell.is_cuda else _cpu_ops(prof)
    total = sum(k["total_ms"] for k in kernels)
    for k in kernels:
        k["share"] = k["total_ms"] / total if total else None
        k["mean_us"] = 1e3 * k["total_ms"] / k["launches"] if k["launches"] else None
    return {
        "hello": hello, "setup": {k: setup.get(k) for k in ("timer", "n_sets", "set_bytes", "warmup_s", "tuning")},
        "trace": str(trace), "device": "cuda" if cell.is_cuda else "cpu",
        "kernels_are": "CUDA kernels" if cell.is_cuda else "CPU ops (no GPU: the profiler's CPU operators)",
        "step_wall_ms": statistics.median(walls), "step_wall_ms_all": walls,
        "device_total_ms": total, "n_launches": sum(k["launches"] for k in kernels), "kernels": kernels[:40],
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", required=True)
    p.add_argument("--registry", required=True)
    p.add_argument("--op", required=True)
    p.add_argument("--cell", help="the cell as the bench sends it (JSON)")
    p.add_argument("--cells", help="a JSON list of cells, each profiled over --steps steps")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True)
    p.add_argument("--side", default="cand", choices=["base", "cand"])
    p.add_argument("--device", default=None, choices=["cuda", "cpu"])
    p.add_argument("--ncu-target", action="store_true")
    args = p.parse_args()
    if bool(args.cell) == bool(args.cells):
        p.error("give --cell or --cells")
    name = f"cells-{args.side}" if args.cells else f"step-{args.side}{'-ncu' if args.ncu_target else ''}"
    result_path = Path(args.out) / f"{name}.json"
    try:
        result = {"ok": True, **(profile_cells(args) if args.cells else profile(args))}
    except BaseException as exc:  # noqa: BLE001 - the orchestrator shows it
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    os.makedirs(args.out, exist_ok=True)
    result_path.write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
