"""Smoke check: build a registered op's inputs and run it forward and backward once.

    TRITON_INTERPRET=1 python -m benchmarks.ops.smoke --device cpu
    python -m benchmarks.ops.smoke --device cuda --shape B4_T2048_H16_D64
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch

from benchmarks.ops.registry import SHAPE_CONFIGS, generate_inputs, get_op, list_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--op', default=None, help='registered op (default: all)')
    parser.add_argument('--shape', default='B1_T64_H2_D32', choices=sorted(SHAPE_CONFIGS))
    parser.add_argument('--dtype', default='float32', choices=['float32', 'float16', 'bfloat16'])
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    args = parser.parse_args()

    for name in [args.op] if args.op else list_ops():
        config = get_op(name)
        inputs = generate_inputs(config, **SHAPE_CONFIGS[args.shape], dtype=getattr(torch, args.dtype),
                                 device=args.device)
        fn = getattr(importlib.import_module(config.import_path), config.func_name or config.name)
        start = time.perf_counter()
        out = fn(**inputs, **config.extra_kwargs)
        out = out[0] if config.output_is_tuple else out
        if not config.skip_backward:
            out.backward(torch.randn_like(out))
        bad = [k for k, t in inputs.items() if t.grad is not None and not torch.isfinite(t.grad).all()]
        if not torch.isfinite(out).all() or bad:
            raise SystemExit(f"{name}: non-finite output or gradients {bad}")
        print(f"{name} {args.shape} {args.dtype} {args.device}: ok, out {tuple(out.shape)} {out.dtype}, "
              f"{time.perf_counter() - start:.2f}s")


if __name__ == '__main__':
    main()
