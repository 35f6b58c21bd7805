"""Causal linear attention, one timestep at a time (Triton forward and backward).

Same op as `chunk_linear_attn`; each program owns one (sequence, head) pair (and a block
of V in the forward) and updates the [K, V] state with one outer product per step:

    S <- S + k_t^T v_t;   o_t = scale * q_t S

Backward: dq_t = scale * do_t S_t^T in a forward sweep; a reverse sweep carries
G (gradient w.r.t. the state), G <- G + scale * q_t^T do_t, dk_t = v_t G^T, dv_t = k_t G.
Slower than the chunked kernel on a GPU (no tensor-core matmuls), but short and easy to
trust, which makes it a useful second implementation.

The step count T_MAX (longest sequence) is a compile-time constant; see the note in
`chunk.py` on why the loop bound is not a runtime value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minifla.ops.linear_attn._common import block_size, check_inputs


@triton.jit
def _seq_bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        seq_len = eos - bos
    else:
        bos = i_n.to(tl.int64) * T
        seq_len = T
    return bos, seq_len


@triton.jit
def fused_recurrent_linear_attn_fwd_kernel(
    q, k, v, o, h0, ht, cu_seqlens,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    T_MAX: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = _seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_state = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_S += tl.load(h0 + p_state, mask=m_kv, other=0.).to(tl.float32)

    # steps past this sequence's end (packed batches of unequal lengths) are fully masked
    for t in range(T_MAX):
        m_t = t < seq_len
        r = (bos + t) * H + i_h
        b_q = tl.load(q + r * K + o_k, mask=m_k & m_t, other=0.).to(tl.float32) * scale
        b_k = tl.load(k + r * K + o_k, mask=m_k & m_t, other=0.).to(tl.float32)
        b_v = tl.load(v + r * V + o_v, mask=m_v & m_t, other=0.).to(tl.float32)
        b_S += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_q[:, None] * b_S, axis=0)
        tl.store(o + r * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v & m_t)

    if STORE_FINAL_STATE:
        tl.store(ht + p_state, b_S.to(ht.dtype.element_ty), mask=m_kv)


@triton.jit
def fused_recurrent_linear_attn_bwd_kernel(
    q, k, v, do, h0, dht, dq, dk, dv, dh0, cu_seqlens,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    T_MAX: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
    STORE_INITIAL_STATE_GRADIENT: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = _seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)

    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_state = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]

    # forward sweep: dq
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_S += tl.load(h0 + p_state, mask=m_kv, other=0.).to(tl.float32)
    for t in range(T_MAX):
        m_t = t < seq_len
        r = (bos + t) * H + i_h
        b_k = tl.load(k + r * K + o_k, mask=m_k & m_t, other=0.).to(tl.float32)
        b_v = tl.load(v + r * V + o_v, mask=m_v & m_t, other=0.).to(tl.float32)
        b_do = tl.load(do + r * V + o_v, mask=m_v & m_t, other=0.).to(tl.float32)
        b_S += b_k[:, None] * b_v[None, :]
        b_dq = tl.sum(b_S * b_do[None, :], axis=1) * scale
        tl.store(dq + r * K + o_k, b_dq.to(dq.dtype.element_ty), mask=m_k & m_t)

    # reverse sweep: dk, dv, dh0
    b_G = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_G += tl.load(dht + p_state, mask=m_kv, other=0.).to(tl.float32)
    for i in range(T_MAX):
        t = T_MAX - 1 - i
        m_t = t < seq_len
        r = (bos + t) * H + i_h
        b_q = tl.load(q + r * K + o_k, mask=m_k & m_t, other=0.).to(tl.float32) * scale
        b_k = tl.load(k + r * K + o_k, mask=m_k & m_t, other=0.).to(tl.float32)
        b_v = tl.load(v + r * V + o_v, mask=m_v & m_t, other=0.).to(tl.float32)
        b_do = tl.load(do + r * V + o_v, mask=m_v & m_t, other=0.).to(tl.float32)
        b_G += b_q[:, None] * b_do[None, :]
        b_dk = tl.sum(b_G * b_v[None, :], axis=1)
        b_dv = tl.sum(b_G * b_k[:, None], axis=0)
        tl.store(dk + r * K + o_k, b_dk.to(dk.dtype.element_ty), mask=m_k & m_t)
        tl.store(dv + r * V + o_v, b_dv.to(dv.dtype.element_ty), mask=m_v & m_t)

    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0 + p_state, b_G.to(dh0.dtype.element_ty), mask=m_kv)


class FusedRecurrentLinearAttnFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, scale, initial_state, output_final_state, cu_seqlens, N, max_len):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if initial_state is not None:
            initial_state = initial_state.contiguous()
        _, T, H, K = q.shape
        V = v.shape[-1]
        BK, BV = block_size(K), min(64, block_size(V))
        o = torch.empty_like(v)
        ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
        fused_recurrent_linear_attn_fwd_kernel[(triton.cdiv(V, BV), N * H)](
            q, k, v, o, initial_state, ht, cu_seqlens,
            scale, T,
            H=H, K=K, V=V, T_MAX=max_len, BK=BK, BV=BV,
            USE_INITIAL_STATE=initial_state is not None,
            STORE_FINAL_STATE=output_final_state,
            IS_VARLEN=cu_seqlens is not None,
        )
        ctx.save_for_backward(q, k, v, initial_state, cu_seqlens)
        ctx.scale = scale
        ctx.N = N
        ctx.max_len = max_len
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, initial_state, cu_seqlens = ctx.saved_tensors
        _, T, H, K = q.shape
        V = v.shape[-1]
        BK, BV = block_size(K), block_size(V)
        do = do.contiguous()
        if dht is not None:
            dht = dht.contiguous()
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        dh0 = torch.empty_like(initial_state) if initial_state is not None else None
        fused_recurrent_linear_attn_bwd_kernel[(ctx.N * H,)](
            q, k, v, do, initial_state, dht, dq, dk, dv, dh0, cu_seqlens,
            ctx.scale, T,
            H=H, K=K, V=V, T_MAX=ctx.max_len, BK=BK, BV=BV,
            USE_INITIAL_STATE=initial_state is not None,
            USE_FINAL_STATE_GRADIENT=dht is not None,
            STORE_INITIAL_STATE_GRADIENT=dh0 is not None,
            IS_VARLEN=cu_seqlens is not None,
            num_warps=8 if BK * BV >= 128 * 128 else 4,
        )
        return dq, dk, dv, None, dh0, None, None, None, None


def fused_recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Causal linear attention (no normalisation), one timestep at a time.

    Same arguments, shapes and results as
    :func:`minifla.ops.linear_attn.chunk.chunk_linear_attn`.
    """
    N, scale, max_len = check_inputs(q, k, v, scale, initial_state, cu_seqlens)
    return FusedRecurrentLinearAttnFunction.apply(
        q, k, v, scale, initial_state, output_final_state, cu_seqlens, N, max_len,
    )
