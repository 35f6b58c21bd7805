"""Chunked causal linear attention: Triton forward and backward kernels.

Per head, with q, k rows of width K and v rows of width V:

    S_t = h0 + sum_{s <= t} k_s^T v_s          (a [K, V] state)
    o_t = scale * q_t S_t

Each Triton program owns one (sequence, head) pair (the forward also splits V into
blocks) and walks the sequence in chunks of BT timesteps, keeping the state in fp32
registers.  Within a chunk, with S the state before the chunk:

    o  = scale * (q S + tril(q k^T) v)
    S <- S + k^T v

Backward, with G the gradient flowing into the state from later timesteps
(G starts as the gradient of the final state):

    dq = scale * (do S^T + tril(do v^T) k)          forward sweep, S as above
    dk = v G^T + scale * triu(v do^T) q             reverse sweep
    dv = k G   + scale * triu(k q^T) do             reverse sweep
    G <- G + scale * q^T do
    dh0 = G after the reverse sweep

Rows past the end of a sequence are loaded as zeros and never stored, so T need not
be a multiple of BT, and packed variable-length batches (`cu_seqlens`) fall out of the
per-sequence program layout.

The number of chunks swept, NT = cdiv(longest sequence, BT), is a compile-time constant
(one compilation per distinct NT); shorter sequences in a packed batch simply run masked
iterations.  A runtime loop bound would avoid the recompiles, but Triton 3.6's interpreter
(TRITON_INTERPRET=1) cannot take one under NumPy >= 2.4 (triton-lang/triton#9171), and these
kernels must run in the interpreter too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minifla.ops.linear_attn._common import block_size, check_inputs, interpreter_dot_safe

# timesteps per chunk; a power of two of at least 16 (tl.dot's smallest tile)
CHUNK_SIZE = 32


@triton.jit
def _seq_bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """First row and length of sequence i_n in the flattened [B*T] (or packed [T]) row space."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        seq_len = eos - bos
    else:
        bos = i_n.to(tl.int64) * T
        seq_len = T
    return bos, seq_len


@triton.jit
def chunk_linear_attn_fwd_kernel(
    q, k, v, o, h0, ht, cu_seqlens,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    NT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = _seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    m_causal = o_t[:, None] >= o_t[None, :]

    # state slice S[:, i_v*BV : (i_v+1)*BV], fp32
    p_state = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_S += tl.load(h0 + p_state, mask=m_kv, other=0.).to(tl.float32)

    for i_t in range(NT):
        rows = i_t * BT + o_t
        m_t = rows < seq_len
        r = (bos + rows) * H + i_h  # flattened (row, head) index
        b_q = tl.load(q + r[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_k = tl.load(k + r[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_v = tl.load(v + r[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)

        b_A = tl.dot(b_q, tl.trans(b_k))
        b_A = tl.where(m_causal, b_A, 0.)
        b_o = tl.dot(b_q, b_S.to(b_q.dtype)) + tl.dot(b_A.to(b_v.dtype), b_v)
        b_o = b_o * scale
        tl.store(o + r[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

        b_S += tl.dot(tl.trans(b_k), b_v)

    if STORE_FINAL_STATE:
        tl.store(ht + p_state, b_S.to(ht.dtype.element_ty), mask=m_kv)


@triton.jit
def chunk_linear_attn_bwd_dq_kernel(
    k, v, do, dq, h0, cu_seqlens,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    NT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = _seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_causal = o_t[:, None] >= o_t[None, :]

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        p_state = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        b_S += tl.load(h0 + p_state, mask=m_k[:, None] & m_v[None, :], other=0.).to(tl.float32)

    for i_t in range(NT):
        rows = i_t * BT + o_t
        m_t = rows < seq_len
        r = (bos + rows) * H + i_h
        b_k = tl.load(k + r[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_v = tl.load(v + r[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)
        b_do = tl.load(do + r[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)

        b_M = tl.dot(b_do, tl.trans(b_v))
        b_M = tl.where(m_causal, b_M, 0.)
        b_dq = tl.dot(b_do, tl.trans(b_S).to(b_do.dtype)) + tl.dot(b_M.to(b_k.dtype), b_k)
        b_dq = b_dq * scale
        tl.store(dq + r[:, None] * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_t[:, None] & m_k[None, :])

        b_S += tl.dot(tl.trans(b_k), b_v)


@triton.jit
def chunk_linear_attn_bwd_dkv_kernel(
    q, k, v, do, dht, dk, dv, dh0, cu_seqlens,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    NT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr, STORE_INITIAL_STATE_GRADIENT: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = _seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    m_anticausal = o_t[:, None] <= o_t[None, :]
    p_state = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]

    # G: gradient w.r.t. the state contributed by later timesteps, fp32
    b_G = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_G += tl.load(dht + p_state, mask=m_kv, other=0.).to(tl.float32)

    for i in range(NT):
        i_t = NT - 1 - i
        rows = i_t * BT + o_t
        m_t = rows < seq_len
        r = (bos + rows) * H + i_h
        b_q = tl.load(q + r[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_k = tl.load(k + r[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_v = tl.load(v + r[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)
        b_do = tl.load(do + r[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)

        # [i, s] = v_i . do_s for s >= i
        b_Mv = tl.where(m_anticausal, tl.dot(b_v, tl.trans(b_do)), 0.)
        b_dk = tl.dot(b_v, tl.trans(b_G).to(b_v.dtype)) + scale * tl.dot(b_Mv.to(b_q.dtype), b_q)
        # [i, s] = k_i . q_s for s >= i
        b_Mk = tl.where(m_anticausal, tl.dot(b_k, tl.trans(b_q)), 0.)
        b_dv = tl.dot(b_k, b_G.to(b_k.dtype)) + scale * tl.dot(b_Mk.to(b_do.dtype), b_do)
        tl.store(dk + r[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_t[:, None] & m_k[None, :])
        tl.store(dv + r[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

        b_G += scale * tl.dot(tl.trans(b_q), b_do)

    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0 + p_state, b_G.to(dh0.dtype.element_ty), mask=m_kv)


def _num_warps(BK: int, BV: int) -> int:
    return 8 if BK * BV >= 128 * 128 else 4


def chunk_linear_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    N: int,
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _, T, H, K = q.shape
    V = v.shape[-1]
    BT = CHUNK_SIZE
    BK = block_size(K)
    BV = min(64, block_size(V))
    o = torch.empty_like(v)
    ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    q, k, v = map(interpreter_dot_safe, (q, k, v))
    grid = (triton.cdiv(V, BV), N * H)
    chunk_linear_attn_fwd_kernel[grid](
        q, k, v, o, initial_state, ht, cu_seqlens,
        scale, T,
        H=H, K=K, V=V, NT=triton.cdiv(max_len, BT), BT=BT, BK=BK, BV=BV,
        USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=output_final_state,
        IS_VARLEN=cu_seqlens is not None,
        num_warps=_num_warps(BK, BV),
    )
    return o, ht


def chunk_linear_attn_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    N: int,
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    _, T, H, K = q.shape
    V = v.shape[-1]
    BT = CHUNK_SIZE
    BK = block_size(K)
    BV = block_size(V)
    num_warps = _num_warps(BK, BV)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dh0 = torch.empty_like(initial_state) if initial_state is not None else None
    q, k, v, do = map(interpreter_dot_safe, (q, k, v, do))

    chunk_linear_attn_bwd_dq_kernel[(N * H,)](
        k, v, do, dq, initial_state, cu_seqlens,
        scale, T,
        H=H, K=K, V=V, NT=triton.cdiv(max_len, BT), BT=BT, BK=BK, BV=BV,
        USE_INITIAL_STATE=initial_state is not None,
        IS_VARLEN=cu_seqlens is not None,
        num_warps=num_warps,
    )
    chunk_linear_attn_bwd_dkv_kernel[(N * H,)](
        q, k, v, do, dht, dk, dv, dh0, cu_seqlens,
        scale, T,
        H=H, K=K, V=V, NT=triton.cdiv(max_len, BT), BT=BT, BK=BK, BV=BV,
        USE_FINAL_STATE_GRADIENT=dht is not None,
        STORE_INITIAL_STATE_GRADIENT=dh0 is not None,
        IS_VARLEN=cu_seqlens is not None,
        num_warps=num_warps,
    )
    return dq, dk, dv, dh0


class ChunkLinearAttnFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, scale, initial_state, output_final_state, cu_seqlens, N, max_len):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if initial_state is not None:
            initial_state = initial_state.contiguous()
        o, ht = chunk_linear_attn_fwd(q, k, v, scale, initial_state, output_final_state, cu_seqlens, N, max_len)
        ctx.save_for_backward(q, k, v, initial_state, cu_seqlens)
        ctx.scale = scale
        ctx.N = N
        ctx.max_len = max_len
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, initial_state, cu_seqlens = ctx.saved_tensors
        if dht is not None:
            dht = dht.contiguous()
        dq, dk, dv, dh0 = chunk_linear_attn_bwd(
            q, k, v, do.contiguous(), dht, ctx.scale, initial_state, cu_seqlens, ctx.N, ctx.max_len,
        )
        return dq, dk, dv, None, dh0, None, None, None, None


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Causal linear attention (no normalisation), computed chunk by chunk.

    Args:
        q (torch.Tensor): queries of shape `[B, T, H, K]`.
        k (torch.Tensor): keys of shape `[B, T, H, K]`.
        v (torch.Tensor): values of shape `[B, T, H, V]`.
        scale (float, Optional): multiplier on `q`; defaults to `K ** -0.5`.
        initial_state (torch.Tensor, Optional): state `[N, H, K, V]` to start from,
            with `N` the batch size, or the number of sequences when `cu_seqlens` is given.
        output_final_state (bool): also return the final state `[N, H, K, V]` (fp32).
        cu_seqlens (torch.LongTensor, Optional): `[N + 1]` offsets of sequences packed
            along `T`; requires `B == 1`.

    Returns:
        `(o, final_state)`: `o` is `[B, T, H, V]` in the input dtype;
        `final_state` is None unless `output_final_state`.
    """
    N, scale, max_len = check_inputs(q, k, v, scale, initial_state, cu_seqlens)
    return ChunkLinearAttnFunction.apply(
        q, k, v, scale, initial_state, output_final_state, cu_seqlens, N, max_len,
    )
