#!/usr/bin/env python3
"""What compute-sanitizer can see, measured on this GPU, with small kernels of known defects.

    python3 benchmarks/sanitizer_reach.py [--out DIR]

Three questions, each answered by runs of this same file under the tool (`--child CASE`):

  reach   memcheck on a Triton kernel that reads past the end of a tensor, with a second tensor
          allocated right after it (PyTorch's caching allocator off, as `flaloop sanitize` runs
          memcheck): which overflows it reports, without and with `--padding`.
  cost    initcheck on a kernel whose every thread reads memory nobody wrote: the wall time as the
          number of bad reads grows, with the host backtrace and without (`--show-backtrace no`).
  race    racecheck on a shared-memory race: a hand-written PTX kernel (each thread stores its slot,
          then reads a slot of another warp with no barrier); the same pattern in Gluon, where it
          is no race (the compiler's barrier pass puts a `bar.sync` between the store and the load:
          read in the PTX of Triton 3.6 for sm_90); and the race Gluon does let through, an
          asynchronous copy into shared memory (cp.async) read with no `wait_group` (the compiler's
          barrier orders the threads, not the copy's arrival), beside the same kernel with the wait.

    python3 benchmarks/sanitizer_reach.py --tools racecheck   # one question only

Prints one line per run and a summary; writes OUT/sanitizer_reach.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

N = 65536  # elements of the tensor read past its end (bf16: 128 KiB, a multiple of 512 bytes)

RACE_PTX = r"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry flaloop_race(.param .u64 out)
{
    .reg .b32 %r<8>;
    .reg .b64 %rd<4>;
    .shared .align 4 .b32 buf[128];
    mov.u32 %r1, %tid.x;
    mov.u32 %r2, buf;
    shl.b32 %r3, %r1, 2;
    add.u32 %r4, %r2, %r3;
    st.shared.u32 [%r4], %r1;
    add.u32 %r5, %r1, 32;
    and.b32 %r5, %r5, 127;
    shl.b32 %r5, %r5, 2;
    add.u32 %r6, %r2, %r5;
    ld.shared.u32 %r7, [%r6];
    ld.param.u64 %rd1, [out];
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.u32 %rd2, %r1, 4;
    add.u64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r7;
    ret;
}
"""


# The Gluon kernels, as module source (Triton's JIT reads a kernel's source from its file, so the
# child writes this to a module of its own and imports it; the FLA plant embeds the same text).
# Each thread writes 4 neighbours and reads back 4 strided ones, written by other warps.
GLUON_RACE = '''
from triton.experimental import gluon as _gluon
from triton.experimental.gluon import language as _gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp


@_gluon.jit
def _stage_through_smem(x, y, N: _gl.constexpr):
    # a plain store, then the load: the compiler orders them with a barrier of its own
    wr: _gl.constexpr = _gl.BlockedLayout([4], [32], [4], [0])
    rd: _gl.constexpr = _gl.BlockedLayout([1], [32], [4], [0])
    smem = _gl.allocate_shared_memory(_gl.float32, [N], _gl.SwizzledSharedLayout(1, 1, 1, [0]))
    smem.store(_gl.load(x + _gl.arange(0, N, layout=wr)))
    _gl.store(y + _gl.arange(0, N, layout=rd), smem.load(rd))


@_gluon.jit
def _stage_async(x, y, N: _gl.constexpr, WAIT: _gl.constexpr):
    # an asynchronous copy into shared memory, then the load: without the wait, the load may run
    # before the copy lands (the barrier the compiler adds orders the threads, not the copy)
    wr: _gl.constexpr = _gl.BlockedLayout([4], [32], [4], [0])
    rd: _gl.constexpr = _gl.BlockedLayout([1], [32], [4], [0])
    smem = _gl.allocate_shared_memory(_gl.float32, [N], _gl.SwizzledSharedLayout(1, 1, 1, [0]))
    _cp.async_copy_global_to_shared(smem, x + _gl.arange(0, N, layout=wr))
    _cp.commit_group()
    if WAIT:
        _cp.wait_group(0)
    _gl.store(y + _gl.arange(0, N, layout=rd), smem.load(rd))
'''
GLUON_CASES = {"race-gluon-sync": ("_stage_through_smem", {}), "race-gluon-async": ("_stage_async", {"WAIT": False}),
               "race-gluon-async-waited": ("_stage_async", {"WAIT": True})}


def ptx_race(out_ptr: int) -> None:
    """Launch RACE_PTX through the driver API on the current context: 1 block of 128 threads."""
    cu = ctypes.CDLL("libcuda.so.1")
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    for call, args in (("cuModuleLoadData", (ctypes.byref(mod), ctypes.c_char_p(RACE_PTX.encode()))),
                       ("cuModuleGetFunction", (ctypes.byref(fn), mod, b"flaloop_race"))):
        rc = getattr(cu, call)(*args)
        if rc:
            raise RuntimeError(f"{call} returned {rc}")
    arg = ctypes.c_uint64(out_ptr)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(arg), ctypes.c_void_p))
    rc = cu.cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, None, params, None)
    if rc:
        raise RuntimeError(f"cuLaunchKernel returned {rc}")


def child(case: str, arg: int) -> None:
    # module globals, not locals: Triton's JIT resolves a kernel's names in its module's globals
    global torch, triton, tl
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def read_at(src, dst, start, n, BLOCK: tl.constexpr):
        o = start + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src + o, mask=o < start + n)  # the mask bounds the read, not the tensor
        tl.store(dst + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), x, mask=o < start + n)

    dev = torch.device("cuda")
    if case == "reach":  # read `arg` bytes past the end of `a`; `b` allocated right after `a`
        a = torch.randn(N, device=dev, dtype=torch.bfloat16)
        b = torch.randn(N, device=dev, dtype=torch.bfloat16)
        n = max(1, arg // 2)
        dst = torch.empty(n, device=dev, dtype=torch.bfloat16)
        read_at[(triton.cdiv(n, 256),)](a, dst, N, n, BLOCK=256)
        torch.cuda.synchronize()
        print(f"a at {a.data_ptr():#x}, b at {b.data_ptr():#x}: gap {b.data_ptr() - a.data_ptr() - 2 * N} bytes")
    elif case == "cost":  # `arg` reads of memory nobody wrote
        src = torch.empty(arg, device=dev, dtype=torch.float32)
        dst = torch.empty(arg, device=dev, dtype=torch.float32)
        read_at[(triton.cdiv(arg, 256),)](src, dst, 0, arg, BLOCK=256)
        torch.cuda.synchronize()
    elif case == "race-ptx":
        out = torch.zeros(128, device=dev, dtype=torch.int32)
        ptx_race(out.data_ptr())
        torch.cuda.synchronize()
    elif case in GLUON_CASES:
        import importlib.util
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="flaloop-reach-")) / "gluon_race.py"
        path.write_text(GLUON_RACE)
        spec = importlib.util.spec_from_file_location("gluon_race", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        kernel, consts = GLUON_CASES[case]
        x = torch.arange(512, device=dev, dtype=torch.float32)
        y = torch.empty_like(x)
        getattr(mod, kernel)[(1,)](x, y, N=512, num_warps=4, **consts)
        torch.cuda.synchronize()
        print(f"rows read back wrong: {int((y != x).sum())} of 512")


SUMMARY = re.compile(r"ERROR SUMMARY: ([\d,]+) error")
RACES = re.compile(r"RACECHECK SUMMARY: ([\d,]+) hazards? displayed \(([\d,]+) errors?, ([\d,]+) warnings?\)")


def run(exe: str, tool: str, case: str, arg: int, flags: list[str], out: Path, timeout: float) -> dict:
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    cmd = [exe, "--tool", tool, "--print-limit", "20", *flags, sys.executable, __file__, "--child", case,
           "--arg", str(arg)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        text, code = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, code = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    wall = time.monotonic() - t0
    name = f"{tool}-{case}-{arg}-{'_'.join(f.strip('-') for f in flags) or 'default'}"
    (out / f"{name}.log").write_text(text[-20000:])
    m, r = SUMMARY.search(text), RACES.search(text)
    errors = int(m[1].replace(",", "")) if m else (int(r[2].replace(",", "")) if r else None)
    row = {"tool": tool, "case": case, "arg": arg, "flags": flags, "exit": code, "wall_s": round(wall, 2),
           "errors": errors, "race_warnings": int(r[3].replace(",", "")) if r else None,
           "gap": next((ln for ln in text.splitlines() if ln.startswith(("a at ", "rows read back"))), None)}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--arg", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sanitizer-reach"))
    ap.add_argument("--tools", default="memcheck,initcheck,racecheck", help="the questions to ask, by tool")
    a = ap.parse_args()
    tools = set(a.tools.split(","))
    if a.child:
        child(a.child, a.arg)
        return 0
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    out = Path(a.out) / "sanitizer_reach"
    out.mkdir(parents=True, exist_ok=True)
    helptext = subprocess.run([exe, "--help"], capture_output=True, text=True).stdout
    (out / "help.txt").write_text(helptext)
    print(subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
    rows = []
    for overflow in (720, 65536) if "memcheck" in tools else ():
        for flags in ([], ["--padding", "1048576"]):
            rows.append(run(exe, "memcheck", "reach", overflow, flags, out, 120))
    slow: set[str] = set()
    for n in (1024, 65536, 1048576) if "initcheck" in tools else ():
        for flags in ([], ["--show-backtrace", "no"]):
            if " ".join(flags) in slow:
                continue  # a smaller count already took a minute: the larger one would eat the budget
            row = run(exe, "initcheck", "cost", n, flags, out, 150)
            rows.append(row)
            if row["exit"] == "timeout" or row["wall_s"] > 60:
                slow.add(" ".join(flags))
    for case in ("race-ptx", *GLUON_CASES) if "racecheck" in tools else ():
        rows.append(run(exe, "racecheck", case, 0, [], out, 120))
    (out / "sanitizer_reach.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
