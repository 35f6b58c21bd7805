"""benchmarks/run.py's `precision` suite (issue 37, item 2): `precision-narrowed`'s bounds against FLA
on the GPU. FLA's chunked kernels against their recurrent forms (the same recurrence summed in
another order) at T=8192 in fp32 and fp16 must stay under the bound; rounding the output through
bf16 (and, for fp32, fp16) must exceed it; and FLA's fp32 path with TRITON_F32_DEFAULT=ieee against
its default says whether its own products run in TF32 (benchmarks/precision_forms.py)."""

from __future__ import annotations

import json
import sys

from harness import ROOT, Ctx, goal, run


def suite_precision(ctx: Ctx) -> None:
    from flaloop.guard.dynamic import PRECISION_BOUNDS

    d = ctx.out / "precision"
    d.mkdir(parents=True, exist_ok=True)
    script = str(ROOT / "benchmarks" / "precision_forms.py")
    path = f"{ctx.fla}:{ROOT}"
    runs = {}
    for name, extra, other in (("default", {}, None), ("ieee", {"TRITON_F32_DEFAULT": "ieee"}, d / "default.json")):
        args = [sys.executable, script, str(d / f"{name}.json"), *([str(other)] if other else [])]
        code, _, _ = run(ctx, args, d / f"{name}-run", flaloop=False, timeout=900,
                            env=ctx.env(PYTHONPATH=path, **extra))
        runs[name] = json.loads((d / f"{name}.json").read_text())["rows"] if code == 0 else []
    rows = [r for r in runs["ieee"] if "error" not in r]
    failed = [f"{r['op']}/{r['dtype']}: {r['error']}" for rr in runs.values() for r in rr if "error" in r]
    honest = {f"{r['op']}/{r['dtype']}": max(r["chunk_vs_recurrent_o"], r["chunk_vs_recurrent_h"]) for r in rows}
    over = {k: v for k, v in honest.items() if v > PRECISION_BOUNDS[k.split("/")[1]]}
    goal("precision-honest-reorder", bool(rows) and not over,
         "chunked vs recurrent at T=8192 (TRITON_F32_DEFAULT=ieee): "
         + ", ".join(f"{k} {v:.2g}" for k, v in honest.items()) + f"; bounds {PRECISION_BOUNDS}"
         + (f"; errors {failed}" if failed else ""))
    narrowed = {f"{r['op']}/{r['dtype']} {how}": r[f"o_through_{how}"] for r in rows for how in ("bf16", "fp16")
                if not (how == "fp16" and r["dtype"] == "float16")}
    under = {k: v for k, v in narrowed.items() if v <= PRECISION_BOUNDS[k.split("/")[1].split()[0]]}
    goal("precision-narrowing-caught", bool(narrowed) and not under,
         "output rounded through a narrower dtype: " + ", ".join(f"{k} {v:.2g}" for k, v in narrowed.items()))
    tf32 = {f"{r['op']}": max(r.get("vs_other_run_o", 0), r.get("vs_other_run_h", 0)) for r in rows
            if r["dtype"] == "float32"}
    default = {f"{r['op']}": max(r["chunk_vs_recurrent_o"], r["chunk_vs_recurrent_h"]) for r in runs["default"]
               if "error" not in r and r["dtype"] == "float32"}
    goal("precision-fp32-is-fp32", bool(tf32) and all(v <= PRECISION_BOUNDS["float32"] for v in
                                                       [*tf32.values(), *default.values()]),
         "FLA's fp32 default against ieee products: " + ", ".join(f"{k} {v:.2g}" for k, v in tf32.items())
         + "; chunked vs recurrent at the default: " + ", ".join(f"{k} {v:.2g}" for k, v in default.items())
         + " (NOT MET: FLA's fp32 cells run TF32 products, and a contract on them allows precision-narrowed)")
