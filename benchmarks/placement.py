#!/usr/bin/env python3
"""Is a process's A/A offset where its buffers landed? An experiment on the GPU machine.

The 12-cell A/A reads per-round offsets of 0.1-0.4% that stay put for a whole round (one pair of
fresh processes) and move between rounds. This script asks whether the same offsets appear
*inside* one process between copies of a cell that differ only in where their memory is: each
child process builds G copies of a cell (same input values, own input tensors, own CUDA graph
and graph memory pool), then times them interleaved. If the copies of one process disagree by
about as much as processes do, placement is the cause and averaging over copies in every
process removes it; if the copies agree and processes do not, it is something of the process.

    python3 benchmarks/placement.py run --procs 6 --copies 4 --out DIR    # needs FLA on PYTHONPATH
    python3 benchmarks/placement.py report DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CELLS = [("B8_T2048_H32_D256", 8, 2048, 32, 256, "fwd"), ("B8_T2048_H32_D256", 8, 2048, 32, 256, "fwdbwd"),
         ("B4_T2048_H16_D128", 4, 2048, 16, 128, "fwd"), ("B8_T1024_H8_D64", 8, 1024, 8, 64, "fwdbwd")]


def child(copies: int, sweeps: int, out: Path) -> None:
    import torch
    import torch.nn.functional as F
    from fla.ops.delta_rule import chunk_delta_rule

    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    rows = []
    for name, B, T, H, D, mode in CELLS:
        made = []
        for _ in range(copies):
            g = torch.Generator(device=dev).manual_seed(0)
            q = F.normalize(torch.randn(B, T, H, D, device=dev, generator=g), dim=-1).bfloat16()
            k = F.normalize(torch.randn(B, T, H, D, device=dev, generator=g), dim=-1).bfloat16()
            v = torch.randn(B, T, H, D, device=dev, generator=g).bfloat16()
            beta = torch.rand(B, T, H, device=dev, generator=g).sigmoid().bfloat16()
            leaves = [q, k, v, beta]
            do = None
            if mode == "fwdbwd":
                for t in leaves:
                    t.requires_grad_(True)
                do = torch.randn(B, T, H, D, device=dev, generator=g).bfloat16()

            def call(leaves=leaves, do=do):
                if do is None:
                    with torch.no_grad():
                        return chunk_delta_rule(*leaves)
                for t in leaves:
                    t.grad = None
                o, _ = chunk_delta_rule(*leaves)
                o.backward(do)
                return o

            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    call()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            call()
            e1.record()
            torch.cuda.synchronize()
            kk = max(1, min(256, math.ceil(10.0 / e0.elapsed_time(e1))))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(kk):
                    call()
            torch.cuda.synchronize()
            made.append((graph, kk, leaves, do))
        times = [[] for _ in range(copies)]
        for sweep in range(sweeps):
            for j in range(copies):
                i = (j + sweep) % copies
                graph, kk = made[i][0], made[i][1]
                flush.zero_()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graph.replay()
                e1.record()
                e1.synchronize()
                times[i].append(e0.elapsed_time(e1) / kk)
        rows.append({"cell": f"{name}/{mode}", "pid": os.getpid(), "k": made[0][1],
                     "median_ms": [statistics.median(t) for t in times], "times": times})
        del made
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def run(procs: int, copies: int, sweeps: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for i in range(procs):
        t0 = time.time()
        subprocess.run([sys.executable, __file__, "child", "--copies", str(copies), "--sweeps", str(sweeps),
                        "--out", str(out / "rows.jsonl")], check=True)
        print(f"process {i + 1}/{procs}: {time.time() - t0:.1f}s", flush=True)


def report(out: Path) -> str:
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines() if x.strip()]
    lines = ["cell: within-process SD of copies (mean over processes) | between-process SD of copy 0 | "
             "between-process SD of the copies' mean (all %, of the cell's grand median)"]
    for cell in dict.fromkeys(r["cell"] for r in rows):
        rs = [r for r in rows if r["cell"] == cell]
        if len(rs) < 2:
            continue
        grand = statistics.median(m for r in rs for m in r["median_ms"])
        within = statistics.mean(statistics.stdev(r["median_ms"]) for r in rs) / grand * 100
        first = statistics.stdev(r["median_ms"][0] for r in rs) / grand * 100
        means = statistics.stdev(statistics.mean(r["median_ms"]) for r in rs) / grand * 100
        lines.append(f"  {cell:28s} within {within:.3f}% | copy 0 across {first:.3f}% | mean across {means:.3f}% "
                     f"({len(rs)} processes, {len(rs[0]['median_ms'])} copies, k {rs[0]['k']}, {grand:.4f} ms)")
        for r in rs:
            lines.append(f"    pid {r['pid']:<7d} " + " ".join(f"{(m / grand - 1) * 100:+.3f}%" for m in r["median_ms"]))
    text = "\n".join(lines)
    (out / "report.txt").write_text(text + "\n")
    return text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["run", "child", "report"])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--out", dest="out_opt")
    ap.add_argument("--procs", type=int, default=6)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--sweeps", type=int, default=16)
    a = ap.parse_args(argv)
    out = Path(a.out_opt or a.out or os.environ.get("OUT", "/tmp/placement"))
    if a.what == "child":
        child(a.copies, a.sweeps, out)
    elif a.what == "run":
        run(a.procs, a.copies, a.sweeps, out)
        print(report(out))
    else:
        print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
