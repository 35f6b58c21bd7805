from minifla.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn

__all__ = ['chunk_linear_attn', 'fused_recurrent_linear_attn']
