"""Correctness gate for the linear-attention kernels.

Every kernel result (output, final state, and the gradients of q, k, v and the
initial state) is compared with the plain-PyTorch reference `naive_linear_attn`.
Shapes are kept tiny so the whole file runs in seconds under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from minifla.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn
from minifla.ops.linear_attn.naive import naive_linear_attn
from minifla.utils import assert_close, device

# allowed relative RMS error per input dtype
TOLERANCE = {
    torch.float32: 0.005,  # GPUs run fp32 tl.dot as tf32
    torch.float16: 0.006,
    torch.bfloat16: 0.01,
}

DTYPE_NAME = {torch.float32: 'fp32', torch.float16: 'fp16', torch.bfloat16: 'bf16'}


def make_inputs(B, T, H, K, V, dtype, use_h0, N=None, seed=42):
    torch.manual_seed(seed)
    N = B if N is None else N
    q = torch.randn(B, T, H, K, dtype=dtype, device=device)
    k = torch.randn(B, T, H, K, dtype=dtype, device=device)
    v = torch.randn(B, T, H, V, dtype=dtype, device=device)
    h0 = torch.randn(N, H, K, V, dtype=torch.float32, device=device) if use_h0 else None
    do = torch.randn(B, T, H, V, dtype=dtype, device=device)
    dht = torch.randn(N, H, K, V, dtype=torch.float32, device=device)
    return q, k, v, h0, do, dht


def run_with_grads(fn, q, k, v, h0, do, dht, **kwargs):
    """Call fn with fresh leaves, backprop <o, do> + <ht, dht>; return o, ht and the grads."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    if h0 is not None:
        h0 = h0.detach().clone().requires_grad_(True)
    o, ht = fn(q, k, v, initial_state=h0, output_final_state=True, **kwargs)
    ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
    return o, ht, q.grad, k.grad, v.grad, (h0.grad if h0 is not None else None)


def compare(ref, tri, ratio):
    for name, r, t in zip(('o', 'ht', 'dq', 'dk', 'dv', 'dh0'), ref, tri, strict=True):
        if r is None:
            assert t is None, f"{name}: expected no tensor"
            continue
        assert t.dtype == r.dtype, f"{name}: dtype {t.dtype}, expected {r.dtype}"
        assert_close(name, r, t, ratio)


@pytest.mark.parametrize(
    ('B', 'T', 'H', 'K', 'V', 'scale', 'use_h0', 'dtype'),
    [
        pytest.param(*case, id="B{}-T{}-H{}-K{}-V{}-scale{}-h0{}-{}".format(*case[:7], DTYPE_NAME[case[7]]))
        for case in [
            (1, 64, 2, 32, 32, 1.0, False, torch.float32),
            (2, 100, 2, 16, 16, 0.1, True, torch.float32),
            (1, 20, 3, 60, 40, 0.5, True, torch.float32),
            (1, 63, 1, 32, 16, None, True, torch.float16),
            (2, 100, 2, 16, 32, 0.25, True, torch.float16),
            (2, 40, 2, 16, 16, 1.0, False, torch.bfloat16),
        ]
    ],
)
def test_chunk(B, T, H, K, V, scale, use_h0, dtype):
    q, k, v, h0, do, dht = make_inputs(B, T, H, K, V, dtype, use_h0)
    ref = run_with_grads(naive_linear_attn, q, k, v, h0, do, dht, scale=scale)
    tri = run_with_grads(chunk_linear_attn, q, k, v, h0, do, dht, scale=scale)
    compare(ref, tri, TOLERANCE[dtype])


@pytest.mark.parametrize(
    ('cu_seqlens', 'H', 'K', 'V', 'dtype'),
    [
        pytest.param(*case, id="cu{}-H{}-K{}-V{}-{}".format('_'.join(map(str, case[0])), *case[1:4],
                                                          DTYPE_NAME[case[4]]))
        for case in [
            ([0, 15, 100, 130], 2, 16, 16, torch.float32),
            ([0, 64, 71, 150], 1, 32, 16, torch.float16),
        ]
    ],
)
def test_chunk_varlen(cu_seqlens, H, K, V, dtype):
    T, N = cu_seqlens[-1], len(cu_seqlens) - 1
    q, k, v, h0, do, dht = make_inputs(1, T, H, K, V, dtype, use_h0=True, N=N)
    offsets = torch.tensor(cu_seqlens, dtype=torch.long, device=device)

    # reference: each packed sequence on its own, then glued back together
    refs = []
    for i, (bos, eos) in enumerate(pairwise(cu_seqlens)):
        part = run_with_grads(
            naive_linear_attn,
            q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], h0[i:i + 1], do[:, bos:eos], dht[i:i + 1],
            scale=0.5,
        )
        refs.append(part)
    ref = [torch.cat([r[j] for r in refs], dim=0 if j in (1, 5) else 1) for j in range(6)]

    tri = run_with_grads(chunk_linear_attn, q, k, v, h0, do, dht, scale=0.5, cu_seqlens=offsets)
    compare(ref, tri, TOLERANCE[dtype])


@pytest.mark.parametrize(
    ('B', 'T', 'H', 'K', 'V', 'use_h0', 'dtype'),
    [
        pytest.param(*case, id="B{}-T{}-H{}-K{}-V{}-h0{}-{}".format(*case[:6], DTYPE_NAME[case[6]]))
        for case in [
            (1, 24, 2, 16, 16, True, torch.float32),
            (2, 17, 1, 32, 16, False, torch.float16),
        ]
    ],
)
def test_fused_recurrent(B, T, H, K, V, use_h0, dtype):
    q, k, v, h0, do, dht = make_inputs(B, T, H, K, V, dtype, use_h0)
    ref = run_with_grads(naive_linear_attn, q, k, v, h0, do, dht, scale=0.3)
    tri = run_with_grads(fused_recurrent_linear_attn, q, k, v, h0, do, dht, scale=0.3)
    compare(ref, tri, TOLERANCE[dtype])


def test_fused_recurrent_varlen():
    cu_seqlens = [0, 5, 21]
    q, k, v, h0, do, dht = make_inputs(1, 21, 2, 16, 16, torch.float32, use_h0=True, N=2)
    refs = [
        run_with_grads(naive_linear_attn, q[:, a:b], k[:, a:b], v[:, a:b], h0[i:i + 1], do[:, a:b], dht[i:i + 1])
        for i, (a, b) in enumerate(pairwise(cu_seqlens))
    ]
    ref = [torch.cat([r[j] for r in refs], dim=0 if j in (1, 5) else 1) for j in range(6)]
    tri = run_with_grads(fused_recurrent_linear_attn, q, k, v, h0, do, dht,
                         cu_seqlens=torch.tensor(cu_seqlens, device=device))
    compare(ref, tri, TOLERANCE[torch.float32])


def test_no_final_state():
    q, k, v, _, _, _ = make_inputs(1, 40, 1, 16, 16, torch.float32, use_h0=False)
    o, ht = chunk_linear_attn(q, k, v)
    assert ht is None
    assert_close('o', naive_linear_attn(q, k, v)[0], o, TOLERANCE[torch.float32])


def test_input_validation():
    q = torch.randn(2, 8, 1, 16, device=device)
    with pytest.raises(ValueError, match='same shape'):
        chunk_linear_attn(q, q[..., :8], q)
    with pytest.raises(ValueError, match='batch size must be 1'):
        chunk_linear_attn(q, q, q, cu_seqlens=torch.tensor([0, 4, 8], device=device))
    with pytest.raises(ValueError, match='initial_state'):
        chunk_linear_attn(q, q, q, initial_state=torch.zeros(1, 1, 16, 16, device=device))
