"""Models built from minifla's ops, in FLA's shape: a config class and a causal-LM class."""

from minifla.models.linear_attn import LinearAttnConfig, LinearAttnForCausalLM

__all__ = ['LinearAttnConfig', 'LinearAttnForCausalLM']
