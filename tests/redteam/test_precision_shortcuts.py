"""Precision shortcuts: TF32, a narrower accumulator, inputs or outputs rounded through bf16 or
fp16: cheaper, and inside a loose tolerance (KernelBench's static checker, "precision downgrade";
FLA chunk_delta_rule on an H200, where a bf16 round trip of the output passed gate and bench).
A rounding that stays inside `--diff-tol` (0.005 relative RMS) passes the differential check; the
static rules read a narrowing they can name, and `precision-narrowed` (guard/dynamic.precision_finding)
catches one named at run time: on fp32 inputs the candidate may differ from the base by what
reordering fp32 arithmetic explains, far less than any rounding through bf16, fp16 or TF32."""

import pytest
from corpus import (
    APPLY,
    CALL,
    CHUNK,
    TOP,
    after,
    assert_honest,
    assert_probed,
    assert_static,
    assert_static_misses,
    probed,
    replace,
)
from support.repos import MINIFLA

from flaloop.guard.dynamic import PRECISION_BOUNDS

STATIC = {
    "bf16-accumulator": ([replace(CHUNK, "    b_S = tl.zeros([BK, BV], dtype=tl.float32)\n",
                                  "    b_S = tl.zeros([BK, BV], dtype=tl.bfloat16)\n")], "numeric-narrow"),
    "bf16-round-trip": ([replace(CHUNK, APPLY, "    o, ht = ChunkLinearAttnFunction.apply(q, k, v, scale, initial_state, "
                                               "output_final_state, cu_seqlens, N, max_len)\n"
                                               "    return o.to(torch.bfloat16).to(q.dtype), ht\n")], "numeric-narrow"),
    "tf32-flag": ([after(CHUNK, TOP, "torch.backends.cuda.matmul.allow_tf32 = True\n")], "numeric-tf32"),
}

DYNAMIC = {
    # TF32 set through setattr on objects reached by names built at run time
    "tf32-by-run-time-names": ([after(CHUNK, TOP, "setattr(getattr(getattr(torch, 'back' + 'ends'), 'cu' + 'da').matmul, "
                                                  "'allow_' + 'tf32', True)\n")], "numeric-settings"),
    # the flag's C++ setter in torch._C, named at run time, on the first call
    "tf32-through-the-c-setter": ([after(CHUNK, CALL, "    getattr(getattr(torch, '_' + 'C'), '_set_cublas_allow_' + 'tf32')(True)\n")],
                                  "numeric-settings"),
}

LOW = "    _lo = getattr(torch, 'bfloat' + '16')\n"
GAPS = {
    # the output rounded through a dtype named at run time: rel-RMS about 0.0016 in fp32
    "output-through-bf16-by-name": [replace(CHUNK, APPLY, LOW + "    o, ht = ChunkLinearAttnFunction.apply(q, k, v, scale, "
                                                        "initial_state, output_final_state, cu_seqlens, N, max_len)\n"
                                                        "    return o.to(_lo).to(q.dtype), ht\n")],
    # the inputs rounded through it, so every product accumulates bf16 operands: about 0.0028
    "inputs-through-bf16-by-name": [after(CHUNK, CALL, LOW + "    q, k, v = (x.to(_lo).to(x.dtype) for x in (q, k, v))\n")],
}

HONEST = {
    "ieee-dot": [replace(CHUNK, "        b_A = tl.dot(b_q, tl.trans(b_k))\n",
                         "        b_A = tl.dot(b_q, tl.trans(b_k), input_precision='ieee')\n")],
    # the same sums in other orders: half the chunk (twice the state updates), and the scale folded
    # into the operands before the products instead of applied to their sum
    "chunk-16": [replace(CHUNK, TOP, "CHUNK_SIZE = 16\n")],
    "scale-before-the-products": [replace(CHUNK, "        b_o = tl.dot(b_q, b_S.to(b_q.dtype)) + tl.dot(b_A.to(b_v.dtype), b_v)\n"
                                                 "        b_o = b_o * scale\n",
                                          "        b_o = tl.dot(b_q * scale, b_S.to(b_q.dtype)) + tl.dot((b_A * scale).to(b_v.dtype), b_v)\n")],
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_disguise_is_blocked_by_the_audit(name):
    edits, rule = STATIC[name]
    assert_static(edits, rule)


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_run_time_disguise_passes_the_audit_and_the_bench_blocks_it(name):
    edits, rule = DYNAMIC[name]
    assert_static_misses(edits)
    assert_probed(name, edits, rule)


@pytest.mark.parametrize("name", sorted(GAPS))
def test_rounding_by_a_run_time_dtype_is_blocked(name):
    assert_static_misses(GAPS[name])
    r = probed(name, GAPS[name], unseen=True)
    assert r.blocking, r.show()


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_change_passes(name):
    assert_honest(name, HONEST[name])


@pytest.mark.parametrize("name", ["chunk-16", "scale-before-the-products"])
def test_a_reordering_moves_the_results_and_stays_far_below_the_bound(name):
    # the honest reorderings do change the bits (the rule is exercised, not skipped on equal results)
    r = probed(name, HONEST[name], samples=0)
    rel = max(t["rel_rms"] for t in r.diff["tensors"].values())
    assert 0 < rel < PRECISION_BOUNDS["float32"] / 20, r.diff


LONG = """
import sys, torch
import minifla.ops.linear_attn.chunk as ch
from minifla.ops.linear_attn import chunk_linear_attn
torch.manual_seed(0)
q, k, v = (torch.randn(1, 8192, 1, 16) for _ in range(3))
k = k / k.norm(dim=-1, keepdim=True)
out = {}
for c in (32, 64):
    ch.CHUNK_SIZE = c
    o, ht = chunk_linear_attn(q, k, v, output_final_state=True)
    out[c] = {'out0': o, 'out1': ht}
torch.save(out, sys.argv[1])
"""


def test_a_chunk_size_change_over_a_long_sequence_stays_far_below_the_bound(tmp_path):
    # the state summed over T=8192 in chunks of 32 against chunks of 64: fp32 reordering over a long
    # recurrence, judged by the worker's comparison and the rule the session calls
    import os
    import subprocess
    import sys

    import torch

    from flaloop.guard.dynamic import precision_finding
    from flaloop.inside.worker.outputs import compare_results

    env = {**os.environ, "PYTHONPATH": str(MINIFLA), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", LONG, str(tmp_path / "long.pt")], env=env, check=True, timeout=120)
    out = torch.load(tmp_path / "long.pt")
    cmp_ = compare_results(out[32], out[64], 0.005)
    rel = max(t["rel_rms"] for t in cmp_["tensors"].values())
    assert cmp_["match"] and 0 < rel < PRECISION_BOUNDS["float32"] / 20, cmp_
    assert precision_finding("long", "float32", cmp_) is None
    # the output rounded through bf16 on the same sequence: blocked, with the numbers in the finding
    narrowed = {"out0": out[64]["out0"].to(torch.bfloat16).float(), "out1": out[64]["out1"]}
    f = precision_finding("long", "float32", compare_results(narrowed, out[64], 0.005))
    assert f is not None and f.blocking and "out0 rel-RMS 0.0016" in f.message and "1e-04" in f.message, f
