"""Plain-PyTorch reference for causal linear attention (fp32 math, autograd-able)."""

from __future__ import annotations

import torch


def naive_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o_t = scale * q_t (h0 + sum_{s<=t} k_s^T v_s), written as one masked attention matrix.

    q, k: [B, T, H, K]; v: [B, T, H, V]; initial_state: [B, H, K, V].
    Returns (o in q's dtype, final state in fp32 or None).
    """
    dtype = q.dtype
    T, K = q.shape[1], q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    q, k, v = q.float(), k.float(), v.float()
    scores = torch.einsum('bthk,bshk->bhts', q, k)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, 0.)
    o = torch.einsum('bhts,bshv->bthv', scores, v)
    if initial_state is not None:
        o = o + torch.einsum('bthk,bhkv->bthv', q, initial_state.float())
    o = o * scale

    final_state = None
    if output_final_state:
        final_state = torch.einsum('bthk,bthv->bhkv', k, v)
        if initial_state is not None:
            final_state = final_state + initial_state.float()
    return o.to(dtype), final_state
