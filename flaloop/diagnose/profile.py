"""`flaloop profile OP`: one step of one bench cell under torch.profiler, base and candidate side by
side, and with `--ncu` Nsight Compute's two collections; recorded for the report.

The torch part runs in the target's interpreter (`probes/profile_step.py`), once in a detached
worktree of the base commit and once in the working tree, with the bench's own input builder.
Results: `profile/<op>-opt/trace/<stamp>/profile.json`, the Chrome/Perfetto traces
(`trace-base.json`, `trace-cand.json`, open them in ui.perfetto.dev) and the `.ncu-rep` reports.

Nsight Compute follows FLA's NVIDIA guidance: `--set full` with the PmSampling sections, and
`--set source` with SourceCounters, always `--clock-control none` (the GPU's own clocks, as the
bench sees them), limited to the kernels of one step by the NVTX range `flaloop_step`. The key
metrics are read back with `ncu --import X.ncu-rep --csv --page raw`. Where ncu is missing or
may not read the counters, the profile says so and keeps the torch.profiler reading.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from flaloop import inside
from flaloop.bench import model as model_mod
from flaloop.bench import roofline
from flaloop.core import clock, fsutil, git, procs
from flaloop.core.errors import MeasurementError, UsageError
from flaloop.core.workspace import PROFILE_FILE, Workspace

SCRIPT = inside.script("profile_step.py")
NCU_SETS = {
    "full": ["--set", "full", "--section", "PmSampling", "--section", "PmSampling_WarpStates"],
    "source": ["--set", "source", "--section", "SourceCounters"],
}
# ncu's raw-page metric names -> what the report calls them (all percentages but the time).
NCU_METRICS = {
    "gpu__time_duration.sum": "duration_us",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory_throughput_pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_throughput_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "compute_sol_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
}
# Other names ncu versions give the same metric (Nsight Compute on the H200 here, 2026-11-30, had no
# dram__throughput column in the raw page; its Speed Of Light section reads gpu__dram_throughput).
NCU_ALIASES = {"gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram__throughput.avg.pct_of_peak_sustained_elapsed"}


def pick_cell(target, contract, shape: str | None, mode: str | None) -> model_mod.Cell:
    spec = target.contract_spec(contract)
    name = shape or (contract.shapes[0] if contract.shapes else None)
    if not name:
        raise UsageError("no shape to profile", "pass --shape NAME (see the contract's shapes)")
    m = mode or (contract.modes[0] if contract.modes else "fwd")
    return model_mod.make_cells(target.shape_configs(spec), [name], [m], "bfloat16", False)[0]


def step_env(ws: Workspace) -> dict:
    """The environment of a step script (profile, explain, sanitize): the workspace's Triton cache
    and the bench's shared autotuning picks, so the step runs the configs the bench measured. The
    script runs under ncu or compute-sanitizer, a grandchild: its lifeline watches this process."""
    env = dict(os.environ)
    env["FLALOOP_LIFELINE_PID"] = str(os.getpid())
    env["TRITON_CACHE_DIR"] = env.get("FLALOOP_TRITON_CACHE_DIR") or str(ws.triton_cache)
    env["TRITON_CACHE_AUTOTUNING"] = "1"  # the bench's shared picks: the profiled step runs the same configs
    return env


def _run_step(python: str, tree: Path, registry: Path, op: str, wire: dict, out: Path, side: str,
               device: str | None, env: dict, prefix: list[str] | None = None, timeout: float = 1800) -> dict:
    cmd = [*(prefix or []), python, str(SCRIPT), "--tree", str(tree), "--registry", str(registry), "--op", op,
           "--cell", json.dumps(wire), "--out", str(out), "--side", side]
    if device:
        cmd += ["--device", device]
    if prefix:
        cmd.append("--ncu-target")
    return run_step_script(cmd, tree, env, timeout, out / f"step-{side}{'-ncu' if prefix else ''}.json", side)


CELL_MARKER = "flaloop-cell "  # a step script's line as it starts a cell (profile_step, sanitize_step)


def run_step_script(cmd: list[str], tree: Path, env: dict, timeout: float, result: Path, side: str,
                    on_cell: Callable[[str], None] | None = None) -> dict:
    """Run a step script (inside/scripts/profile_step.py) in `tree` and read the result it writes; a
    MeasurementError naming the side when it times out, dies without a result or reports a failure.
    `on_cell` hears each cell the script starts, as it starts it."""
    err: list[str] = []

    def on_line(line: str) -> None:
        err.append(line)
        if on_cell and line.startswith(CELL_MARKER):
            on_cell(line[len(CELL_MARKER):].strip())

    with procs.spawn(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     errors="replace", bufsize=1) as proc:
        outs: list[str] = []
        reader = threading.Thread(target=lambda: outs.append(proc.stdout.read()), daemon=True)
        reader.start()
        expired = procs.follow(proc, proc.stderr, on_line, timeout)
        reader.join(5)
    stdout, stderr = "".join(outs), "".join(err)
    if expired:
        raise MeasurementError(f"profiling the {side} side took longer than {timeout:.0f}s")
    if not result.exists():
        raise MeasurementError(f"the profile probe died on the {side} side (exit {proc.returncode})",
                               (stderr or stdout)[-3000:])
    data = json.loads(result.read_text())
    data["_stdout"], data["_stderr"] = stdout[-4000:], stderr[-4000:]
    if not data.get("ok"):
        raise MeasurementError(f"profiling the {side} side failed: {data.get('error')}",
                               data.get("traceback", "")[-3000:])
    return data


def check_provenance(hello: dict, tree: Path, op: str, side: str, what: str = "profile") -> None:
    """Refuse a reading of an installed copy of the op instead of the tree's own."""
    where = (hello or {}).get("op_module_file") or ""
    if where and not os.path.realpath(where).startswith(os.path.realpath(tree) + os.sep):
        raise MeasurementError(f"the {side} side imported {op} from {where}, not from {tree}",
                               f"an installed copy shadows the tree: refusing to {what} the wrong code")


def ncu_status(ncu: str | None = None) -> tuple[str | None, str]:
    path = ncu or shutil.which("ncu")
    if not path:
        return None, "Nsight Compute (ncu) is not installed or not on PATH: torch.profiler only"
    return path, "ok"


def ncu_forbidden(text: str) -> str | None:
    """The reason ncu could not collect, when its output says it was refused."""
    if "ERR_NVGPUCTRPERM" in text:
        return ("ncu may not read the GPU performance counters (ERR_NVGPUCTRPERM): "
                "needs root or NVreg_RestrictProfilingToAdminUsers=0")
    if "==ERROR==" in text:
        line = next(ln for ln in text.splitlines() if "==ERROR==" in ln)
        return f"ncu failed: {line.strip()}"
    return None


def summarize_ncu_csv(text: str) -> dict:
    """Key metrics of one report (`ncu --import R --csv --page raw`): per kernel, and over the
    step (duration-weighted means), top kernels by duration."""
    rows = list(csv.reader(io.StringIO(text)))
    rows = [r for r in rows if r and not r[0].startswith("==")]
    if len(rows) < 2:
        return {"kernels": []}
    header, body = rows[0], rows[1:]
    if body and not any(c.strip().replace(".", "", 1).isdigit() for c in body[0][:3]) and "ID" in header:
        body = body[1:]  # the units row
    col = {name: i for i, name in enumerate(header)}
    for alias, name in NCU_ALIASES.items():
        if name not in col and alias in col:
            col[name] = col[alias]
    name_col = col.get("Kernel Name", col.get("Function Name"))
    kernels = []
    for r in body:
        k = {"name": r[name_col] if name_col is not None and name_col < len(r) else "?"}
        for metric, key in NCU_METRICS.items():
            i = col.get(metric)
            k[key] = _num(r[i]) if i is not None and i < len(r) else None
        kernels.append(k)
    out: dict = {"kernels": sorted(kernels, key=lambda k: -(k["duration_us"] or 0))[:10]}
    total = sum(k["duration_us"] or 0 for k in kernels)
    out["total_us"] = total
    out["n_kernels"] = len(kernels)
    for key in NCU_METRICS.values():
        if key == "duration_us":
            continue
        pairs = [(k[key], k["duration_us"] or 0) for k in kernels if k[key] is not None]
        w = sum(d for _, d in pairs)
        out[key] = sum(v * d for v, d in pairs) / w if w else None
    return out


def _num(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def run_ncu(ncu: str, python: str, trees: dict[str, Path], registry: Path, op: str, wire: dict, out: Path,
            env: dict, device: str | None) -> dict:
    reports: dict[str, dict] = {}
    summary: dict[str, dict] = {}
    for side, tree in trees.items():
        reports[side] = {}
        for name, flags in NCU_SETS.items():
            rep = out / f"{name}_{side}"
            prefix = [ncu, *flags, "--clock-control", "none", "--nvtx", "--nvtx-include", "flaloop_step/",
                      "--export", str(rep), "--force-overwrite"]
            try:
                data = _run_step(python, tree, registry, op, wire, out, side, device, env, prefix=prefix)
            except MeasurementError as exc:
                why = ncu_forbidden(f"{exc.message}\n{exc.hint or ''}") or exc.message
                return {"available": False, "reason": why, "reports": reports, "summary": summary}
            why = ncu_forbidden(data["_stdout"] + data["_stderr"])
            path = rep.with_suffix(".ncu-rep")
            if why or not path.exists():
                return {"available": False, "reason": why or f"ncu wrote no report {path.name}",
                        "reports": reports, "summary": summary}
            reports[side][name] = str(path)
        proc = subprocess.run([ncu, "--import", reports[side]["full"], "--csv", "--page", "raw"],
                              capture_output=True, text=True)
        summary[side] = summarize_ncu_csv(proc.stdout)
    return {"available": True, "reason": "ok", "reports": reports, "summary": summary}


def profile(target, contract, *, shape: str | None = None, mode: str | None = None, ncu: bool = False,
            device: str | None = None, command: str = "", on_event: Callable[..., None] | None = None) -> dict:
    """Profile one step of one cell on both sides; write and return profile.json's content."""
    say = on_event or (lambda *a, **k: None)
    cell = pick_cell(target, contract, shape, mode)
    wire = cell.to_wire(model_mod.BenchConfig(inputs=dict(contract.input_overrides), sample_ms=1.0), 1, "eager")
    ws = target.workspace(contract.op)
    stamp = clock.now_stamp()
    out = ws.trace / stamp
    out.mkdir(parents=True, exist_ok=True)
    env = step_env(ws)
    state = git.tree_state(target.root)
    doc: dict = {"kind": "profile", "schema": 1, "op": contract.op, "created": stamp, "command": command,
                 "cell": {**cell.to_wire(model_mod.BenchConfig(sample_ms=1.0), None, "eager"), "shape_name": cell.shape_name},
                 "base_commit": contract.base_commit, "candidate": state}
    with git.worktree(target.root, contract.base_commit, "base") as base_tree:
        registry = target.worker_registry(contract, base_tree, out)
        trees = {"base": base_tree, "cand": target.root}
        for side, tree in trees.items():
            say("side", side=side)
            data = _run_step(target.python, tree, registry, contract.op, wire, out, side, device, env)
            for key in ("_stdout", "_stderr"):
                data.pop(key, None)
            check_provenance(data.get("hello"), tree, contract.op, side)
            doc[side] = data
        doc["device"] = doc["cand"]["device"]
        doc["kernels_are"] = doc["cand"]["kernels_are"]
        if ncu and doc["device"] != "cuda":
            doc["ncu"] = {"available": False, "reason": "no GPU: Nsight Compute profiles CUDA kernels only"}
        elif ncu:
            path, why = ncu_status()
            if path is None:
                doc["ncu"] = {"available": False, "reason": why}
            else:
                say("ncu")
                # the torch.profiler reading is kept even if Nsight Compute (minutes) is cut short
                fsutil.atomic_write_json(out / PROFILE_FILE, {**doc, "ncu": {"available": True, "reason": "running"},
                                                                  "path": str(out / PROFILE_FILE)})
                doc["ncu"] = run_ncu(path, target.python, trees, registry, contract.op, wire, out, env, device)
        else:
            doc["ncu"] = {"available": False, "reason": "not requested (--ncu)"}
    uuid = doc["cand"]["hello"].get("device_uuid")
    try:
        say("ceilings")
        ceil = roofline.ceilings_for(target.python, uuid)
        doc["ceilings"] = ceil.to_dict()
    except MeasurementError as exc:
        ceil, doc["ceilings"] = None, {"error": exc.message}
    fam = roofline.family_for(target.op(contract.op).registry, contract.op)
    if fam is not None:
        cost = roofline.cell_cost(fam, cell.shape, cell.mode, cell.dtype, list(cell.seqlens) if cell.seqlens else None)
        roof = {"family": fam.name, "bytes": cost.bytes, "flops": cost.flops}
        if ceil:
            floor, bound = ceil.floor_ms(cost.bytes, cost.flops)
            roof.update(floor_ms=floor, bound=bound, **{
                f"pct_of_floor_{s}": (100 * floor / doc[s]["device_total_ms"] if doc[s]["device_total_ms"] else None)
                for s in ("base", "cand")})
        doc["roofline"] = roof
    else:
        doc["roofline"] = None
    doc["path"] = str(out / PROFILE_FILE)
    fsutil.atomic_write_json(out / PROFILE_FILE, doc)
    return doc
