from minifla.ops.linear_attn.chunk import chunk_linear_attn
from minifla.ops.linear_attn.fused_recurrent import fused_recurrent_linear_attn

__all__ = ['chunk_linear_attn', 'fused_recurrent_linear_attn']
