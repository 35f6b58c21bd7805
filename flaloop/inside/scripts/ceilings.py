"""Runs inside the TARGET's interpreter, as a script: measures the device's two ceilings.

    python ceilings.py --device cuda --uuid GPU-... --out OUT.json
    python ceilings.py --device cpu --out OUT.json

- copy bandwidth: `dst.copy_(src)` of a large buffer, bytes read + written per second (best of
  the repetitions: the floor must be a lower bound on time, so the ceiling is the best seen);
- dense GEMM rate: an n x n x n matmul on random data (bf16 on a GPU, fp32 on the CPU), 2*n^3
  FLOPs per call, best of the repetitions.

On an H200 these read about 4.3 TB/s and 790 TFLOP/s. Never imports flaloop.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback


def _pick_cuda(torch, uuid: str | None):
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
    if uuid:
        want = uuid.lower().removeprefix("gpu-")
        for i in range(torch.cuda.device_count()):
            got = str(getattr(torch.cuda.get_device_properties(i), "uuid", "")).lower().removeprefix("gpu-")
            if got == want:
                return i
        raise RuntimeError(f"no visible GPU has UUID {uuid}")
    return torch.cuda.current_device()


def _best_ms(torch, fn, reps: int, cuda: bool) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        best = min(best, ms)
    return best


def measure(device: str, uuid: str | None) -> dict:
    import torch

    cuda = device == "cuda"
    if cuda:
        idx = _pick_cuda(torch, uuid)
        torch.cuda.set_device(idx)
        props = torch.cuda.get_device_properties(idx)
        name, dev = props.name, torch.device("cuda", idx)
        copy_bytes, gemm_n, dtype, reps = 1 << 30, 8192, torch.bfloat16, 20
    else:
        import platform

        name, dev = platform.processor() or platform.machine() or "cpu", torch.device("cpu")
        copy_bytes, gemm_n, dtype, reps = 64 << 20, 1024, torch.float32, 5
    src = torch.randint(0, 255, (copy_bytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = _best_ms(torch, lambda s=src, d=dst: d.copy_(s), reps, cuda)
    src = dst = None  # free the buffers before the GEMM
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    a = torch.randn(gemm_n, gemm_n, device=dev, dtype=dtype, generator=gen)
    b = torch.randn(gemm_n, gemm_n, device=dev, dtype=dtype, generator=gen)
    c = torch.empty(gemm_n, gemm_n, device=dev, dtype=dtype)
    gemm_ms = _best_ms(torch, lambda: torch.matmul(a, b, out=c), reps, cuda)
    return {
        "device": "cuda" if cuda else "cpu", "device_name": name, "device_uuid": uuid if cuda else None,
        "bandwidth_gbs": 2 * copy_bytes / (copy_ms * 1e-3) / 1e9,
        "peak_tflops": 2 * gemm_n ** 3 / (gemm_ms * 1e-3) / 1e12,
        "gemm_dtype": str(dtype).replace("torch.", ""), "copy_bytes": copy_bytes, "gemm_n": gemm_n,
        "copy_ms": copy_ms, "gemm_ms": gemm_ms, "torch": torch.__version__,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cuda", "cpu"], required=True)
    p.add_argument("--uuid", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    try:
        result = {"ok": True, **measure(args.device, args.uuid)}
    except BaseException as exc:  # noqa: BLE001 - the orchestrator shows it
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    with open(args.out, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
