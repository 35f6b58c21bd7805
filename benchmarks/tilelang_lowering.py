"""Which tilelang release can lower FLA's TileLang kernels, asked on a CPU machine (no GPU, no nvcc).

FLA's TileLang backend compiles each kernel for the shapes a call brings. A release whose lowering
rejects one of the shapes FLA's own tests use makes those tests fail at the base, and the loop's
gate then refuses to start (docs/BENCHMARKS.md: tilelang 0.1.15 on the H200). Lowering, the step
that failed there, runs without a GPU: this script lowers, for sm_90, every kernel configuration
that FLA's `tests/ops/test_attn.py` (bc3b101d) reaches in `parallel_attn`'s TileLang forward and
backward, and GDN's `chunk_bwd_dqkwg` at the survey's shape, and prints what fails. Passing here
does not prove the GPU gate green (nvcc, the run and the numerics come after); failing here
predicts it red.

    pip install --no-deps --target /tmp/tl tilelang==0.1.13 apache-tvm-ffi==0.1.12 \
        torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0 psutil tqdm cloudpickle ml-dtypes einops
    PYTHONPATH=/tmp/tl:.fla python benchmarks/tilelang_lowering.py [--jobs 2] [--json] [--head-dims]

Exit 0 when every case lowers, 1 when one does not, 2 when tilelang or FLA cannot be imported.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import time
from typing import NamedTuple


class Case(NamedTuple):
    """One kernel configuration. T is dynamic in the kernels (not a compile-time constant): it only
    names the case. `side` is fwd or bwd for the attention kernels, None for GDN's."""

    test: str
    B: int
    T: int
    H: int
    HQ: int  # query heads; GDN's value heads
    D: int
    W: int | None = None  # sliding window
    varlen: bool = False
    gated: bool = False
    sink: bool = False
    dw: bool = False  # GDN: the delta rule's dw
    side: str | None = None

    @property
    def name(self) -> str:
        if self.side is None:
            return f"{self.test} B{self.B} H{self.H} D{self.D} dw={self.dw} varlen={self.varlen}"
        return (f"{self.test} {self.side} B{self.B} T{self.T} H{self.H} HQ{self.HQ} D{self.D}"
                + (f" W{self.W}" if self.W else "") + (" varlen" if self.varlen else "")
                + (" gated" if self.gated else "") + (" sink" if self.sink else ""))


# FLA's tests/ops/test_attn.py at bc3b101d
ATTN_CASES = [
    *[Case("test_parallel", B, T, H, HQ, D) for B, T, H, HQ, D in
      ((1, 63, 1, 1, 64), (3, 111, 2, 2, 100), (3, 1024, 2, 8, 60), (3, 1024, 2, 8, 128), (4, 2048, 2, 8, 64))],
    *[Case("test_parallel_with_g", B, T, H, HQ, D, gated=True) for B, T, H, HQ, D in
      ((1, 63, 1, 1, 64), (3, 111, 2, 2, 100), (3, 1024, 2, 8, 60))],
    *[Case("test_parallel_varlen", 1, T, H, HQ, D, varlen=True) for H, HQ, D, T in
      ((2, 2, 64, 15), (2, 8, 64, 1000), (2, 2, 100, 2000))],
    *[Case("test_parallel_swa", B, T, H, HQ, D, W) for B, T, H, HQ, D, W in
      ((1, 63, 1, 1, 64, 16), (3, 111, 2, 2, 100, 32), (3, 1024, 2, 8, 128, 64))],
    *[Case("test_parallel_sink", B, T, H, HQ, D, sink=True) for B, T, H, HQ, D in
      ((1, 63, 1, 1, 64), (3, 111, 2, 2, 100), (3, 1024, 2, 8, 128))],
    *[Case("test_parallel_swa_varlen", 1, T, H, HQ, D, W, varlen=True) for H, HQ, D, W, T in
      ((2, 2, 64, 16, 111), (2, 8, 100, 32, 1000))],
]
# GDN's gated backward (chunk_bwd_dqkwg), served by TileLang on Hopper in the survey: B8_T1024_H8_D64
# and a head dim of 128, with and without the delta rule's dw, fixed-length and varlen
GDN_CASES = [Case("chunk_bwd_dqkwg", 8, 1024, 8, 8, D, varlen=varlen, gated=True, dw=dw)
             for D in (64, 128) for dw in (False, True) for varlen in (False, True)]
# --head-dims: head dims FLA's tests do not use, at the shape where flaloop's unseen-shape probe found
# the forward failing on the H200 (D40: `bench parallel_attn --cand-env FLA_TILELANG=1`, twentieth
# session); FLA's TileLang verifier checks only the dtype, so such a call reaches the compile
HEAD_DIM_CASES = [Case("head dim", 2, 63, 1, 1, D) for D in (16, 32, 40, 48, 80, 96, 112, 192, 256)]


def _lower(c: Case) -> tuple[str, float, str | None]:
    """(name, seconds, None or the error's last line) of lowering one case for sm_90."""
    import tilelang
    from fla.ops.utils.constant import RCP_LN2
    from tilelang import tvm

    t0 = time.perf_counter()
    try:
        if c.side is None:
            from fla.ops.common.backends.tilelang import chunk_bwd

            NK = (c.D + 63) // 64
            tir = chunk_bwd._build_kernel.get_tir(c.B, c.H, c.HQ, c.D, c.D, 64, 64, 64, NK, c.D, c.D, "bfloat16",
                                                  c.gated, c.dw, False, c.varlen, num_warps=4)
        else:
            from fla.ops.common.backends.tilelang import parallel_attn_bwd, parallel_attn_fwd

            s = c.D ** -0.5
            common = dict(USE_G=c.gated, USE_WINDOW=c.W is not None, WINDOW_SIZE=c.W or 0, IS_VARLEN=c.varlen)
            if c.side == "fwd":
                BT, BS, warps = parallel_attn_fwd._pick_tile(c.D, c.D, True)  # as FLA picks on Hopper
                tir = parallel_attn_fwd._build_parallel_attn_fwd_kernel.get_tir(
                    c.B, c.HQ, c.H, c.D, c.D, BT, BS, s, s * RCP_LN2, "float16", USE_SINK=c.sink,
                    num_warps=warps, num_stages=1 if c.W is not None else 2, **common)
            else:
                tir = parallel_attn_bwd._build_parallel_attn_bwd_kernel.get_tir(
                    c.B, c.HQ, c.H, c.D, c.D, 64, s, s * RCP_LN2, "float16", **common)
        target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
        config = {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True, tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
        with target, tvm.transform.PassContext(config=config):
            tilelang.lower(tir, target=target)
        return c.name, time.perf_counter() - t0, None
    except Exception as e:  # noqa: BLE001 - the error is the finding
        last = (str(e).strip().splitlines() or [""])[-1][:300]
        return c.name, time.perf_counter() - t0, f"{type(e).__name__}: {last}"


def cases(head_dims: bool = False) -> list[Case]:
    """The attention cases once per side, those whose compile-time key repeats dropped (the backward
    has no sink), then GDN's; with `head_dims`, HEAD_DIM_CASES on both sides after them."""
    out, seen = [], set()
    for c in ATTN_CASES + (HEAD_DIM_CASES if head_dims else []):
        for side in ("fwd", "bwd"):
            key = (side, c.B, c.H, c.HQ, c.D, c.W, c.varlen, c.gated, c.sink and side == "fwd")
            if key not in seen:
                seen.add(key)
                out.append(c._replace(side=side))
    extra = [c for c in out if c.test == HEAD_DIM_CASES[0].test]
    return [c for c in out if c not in extra] + GDN_CASES + extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2, help="cases lowered at once (each in its own process)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--head-dims", action="store_true",
                    help="also the forward and backward at head dims FLA's tests do not use (HEAD_DIM_CASES)")
    args = ap.parse_args(argv)
    try:
        import fla.ops.common.backends.tilelang.parallel_attn_fwd  # noqa: F401
        import tilelang
    except Exception as e:  # noqa: BLE001
        print(f"error: cannot import tilelang and FLA's TileLang kernels ({type(e).__name__}: {e}); put both on "
              "PYTHONPATH (this script's docstring says how)", file=sys.stderr)
        return 2
    todo = cases(args.head_dims)
    t0 = time.perf_counter()
    results = []
    with cf.ProcessPoolExecutor(max(args.jobs, 1)) as pool:
        for i, (name, secs, error) in enumerate(pool.map(_lower, todo), 1):
            results.append({"case": name, "seconds": round(secs, 1), "error": error})
            if not args.json:
                print(f"[{i}/{len(todo)}] {name}: " + (f"FAILED {error}" if error else f"lowered in {secs:.1f}s"),
                      flush=True)
    failed = [r for r in results if r["error"]]
    summary = f"tilelang {tilelang.__version__}: {len(results) - len(failed)} of {len(results)} lowered for sm_90 " \
              f"in {time.perf_counter() - t0:.0f}s"
    if args.json:
        print(json.dumps({"tilelang": tilelang.__version__, "lowered": len(results) - len(failed),
                          "cases": len(results), "failed": failed, "results": results}, indent=1))
    else:
        print(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
