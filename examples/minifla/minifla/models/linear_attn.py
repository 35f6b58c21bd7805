"""A causal language model whose token mixer is `chunk_linear_attn`, in FLA's style.

`LinearAttnForCausalLM(config)(input_ids=x, labels=x)` returns an object with `.loss` (the
labels are shifted inside, as FLA's and Hugging Face's causal LMs do) and `.logits`.
Small enough to train a few steps on the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minifla.ops.linear_attn import chunk_linear_attn


@dataclass
class LinearAttnConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_heads: int = 2
    num_hidden_layers: int = 1
    hidden_ratio: int = 2
    initializer_range: float = 0.02


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class LinearAttention(nn.Module):
    def __init__(self, config: LinearAttnConfig):
        super().__init__()
        if config.hidden_size % config.num_heads:
            raise ValueError(f'hidden_size {config.hidden_size} is not a multiple of num_heads {config.num_heads}')
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        # feature maps keep the unnormalised state bounded, as FLA's linear attention layers do
        o, _ = chunk_linear_attn(F.elu(q) + 1, F.elu(k) + 1, v)
        return self.o_proj(o.reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, config: LinearAttnConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden_size)
        self.attn = LinearAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.hidden_ratio * config.hidden_size),
                                 nn.SiLU(), nn.Linear(config.hidden_ratio * config.hidden_size, config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LinearAttnForCausalLM(nn.Module):
    def __init__(self, config: LinearAttnConfig):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=config.initializer_range)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)
