"""Input checks and launch sizes shared by the linear-attention kernels."""

from __future__ import annotations

from itertools import pairwise

import torch
import triton

from minifla.utils import check_triton_device

MAX_HEAD_DIM = 256


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[int, float, int]:
    """Validate the public arguments; return (number of sequences N, scale, longest sequence length)."""
    for name, t in (('q', q), ('k', k), ('v', v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, T, H, D], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.shape != q.shape:
        raise ValueError(
            f"q and k must have the same shape [B, T, H, K], got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v must be [B, T, H, V] with the same B, T, H as q, got q {tuple(q.shape)} and v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head dims above {MAX_HEAD_DIM} are not supported, got K={K}, V={V}")
    if T == 0:
        raise ValueError("sequence length T must be positive")

    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(
                f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={B}; "
                "flatten the batch into one row first"
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be a 1-D tensor of N+1 offsets, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be an int32/int64 tensor, got {cu_seqlens.dtype}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens must be on {q.device}, got {cu_seqlens.device}")
        offsets = cu_seqlens.tolist()
        if offsets[0] != 0 or offsets[-1] != T or any(a > b for a, b in pairwise(offsets)):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {offsets}")
        N = len(offsets) - 1
        max_len = max(b - a for a, b in pairwise(offsets))
    else:
        N = B
        max_len = T

    if initial_state is not None:
        if initial_state.shape != (N, H, K, V):
            raise ValueError(
                f"initial_state must be [N, H, K, V] = {(N, H, K, V)}, got {tuple(initial_state.shape)}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"initial_state must be on {q.device}, got {initial_state.device}")

    check_triton_device(q)
    if scale is None:
        scale = K ** -0.5
    return N, float(scale), max_len


def block_size(d: int) -> int:
    """Padded (power of two, at least 16 for tl.dot) block covering a head dim."""
    return max(16, triton.next_power_of_2(d))


def interpreter_dot_safe(t: torch.Tensor | None) -> torch.Tensor | None:
    """Upcast bf16 tensors to fp32 before they reach a kernel that uses tl.dot, under the interpreter.

    Triton's interpreter (TRITON_INTERPRET=1, read when the kernels are defined) multiplies the
    raw uint16 bit patterns of bf16 operands in tl.dot (Triton 3.6), giving garbage, and it does
    so for CUDA tensors too: it copies them to the host and runs NumPy.  CPU tensors only ever
    run under the interpreter.  fp16 and fp32 are fine, and compiled kernels on a GPU get their
    tensors unchanged.  Outputs keep their bf16 dtype: the kernels convert on store.
    """
    if t is None or t.dtype != torch.bfloat16:
        return t
    if t.device.type == 'cpu' or triton.knobs.runtime.interpret:
        return t.float()
    return t
