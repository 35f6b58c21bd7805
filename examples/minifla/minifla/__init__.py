"""minifla: a tiny FLA-shaped package of Triton linear-attention kernels."""

from minifla.ops import chunk_linear_attn, fused_recurrent_linear_attn

__all__ = ['chunk_linear_attn', 'fused_recurrent_linear_attn']
__version__ = '0.1.0'
