"""The built-in decoder-only transformer: pre-norm blocks, causal attention, KV cache, value head.

    >>> from flowrl.models import TinyLMSpec, build_model
    >>> policy = build_model(TinyLMSpec(d_model=64, n_layers=2, n_heads=4), seed=0)
    >>> critic = build_model(TinyLMSpec(d_model=64, n_layers=2, n_heads=4), value_head=True, seed=0)

Initialisation is a pure function of ``(spec, seed)`` -- every process that builds the policy from
the same graph gets bitwise the same weights without any transfer -- and the critic's trunk equals
the policy's (heads are initialised last). A policy starts near uniform over the vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flowrl.models.base import CausalLM
from flowrl.models.spec import TinyLMSpec


@dataclass
class KVCache:
    """Per-layer key and value buffers ``[B, H, max_len, Dh]``; positions ``< length`` are filled."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, H, S, Dh]; cos/sin [S, Dh/2]: rotate channel pairs (i, i + Dh/2) by the position angle.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class _Attention(nn.Module):
    def __init__(self, spec: TinyLMSpec) -> None:
        super().__init__()
        self.n_heads = spec.n_heads
        self.head_dim = spec.d_model // spec.n_heads
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.d_model)

    def forward(self, x, rope, cache: KVCache | None, layer: int, start: int) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if rope is not None:  # q, k [B, H, S, Dh]
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            cache.keys[layer][:, :, start : start + s] = k
            cache.values[layer][:, :, start : start + s] = v
            k = cache.keys[layer][:, :, : start + s]
            v = cache.values[layer][:, :, : start + s]
            if s == 1:  # one new token sees every cached position
                out = F.scaled_dot_product_attention(q, k, v)
            else:  # new token i (position start+i) sees positions <= start+i
                allowed = torch.arange(start + s)[None] <= torch.arange(start, start + s)[:, None]
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class _Block(nn.Module):
    def __init__(self, spec: TinyLMSpec) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.d_model)
        self.attn = _Attention(spec)
        self.ln2 = nn.LayerNorm(spec.d_model)
        self.fc = nn.Linear(spec.d_model, spec.mlp_ratio * spec.d_model)
        self.proj = nn.Linear(spec.mlp_ratio * spec.d_model, spec.d_model)

    def forward(self, x, rope, cache, layer, start) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rope, cache, layer, start)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TinyLM(CausalLM):
    """A policy (``lm_head``) or, with ``value_head=True``, a critic (one value per token)."""

    def __init__(self, spec: TinyLMSpec, *, value_head: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.spec = spec
        self.vocab_size = spec.vocab_size
        self.has_value_head = value_head
        self.tok_emb = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos_emb = nn.Embedding(spec.max_seq_len, spec.d_model) if spec.positions == "learned" else None
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.n_layers))
        self.norm = nn.LayerNorm(spec.d_model)
        if value_head:
            self.value_head = nn.Linear(spec.d_model, 1)
        else:
            self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
            if spec.tie_embeddings:
                self.lm_head.weight = self.tok_emb.weight
        if spec.positions == "rope":
            half = spec.d_model // spec.n_heads // 2
            inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
            angles = torch.arange(spec.max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None]
            self.register_buffer("rope_cos", angles.cos(), persistent=False)
            self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        std = self.spec.init_std
        heads = {"lm_head.weight", "value_head.weight", "value_head.bias"}
        for name, p in self.named_parameters():  # trunk first, in a fixed order; heads below
            if name in heads:
                continue
            if name.endswith(".bias") or ".ln" in name or name.startswith("norm."):
                p.copy_(torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p))
            elif name.endswith("proj.weight"):  # residual outputs: keep the stream's variance flat
                p.normal_(0.0, std / math.sqrt(2 * self.spec.n_layers), generator=gen)
            else:
                p.normal_(0.0, std, generator=gen)
        if self.has_value_head:
            self.value_head.weight.zero_()
            self.value_head.bias.zero_()
        elif not self.spec.tie_embeddings:
            self.lm_head.weight.normal_(0.0, std, generator=gen)

    def _trunk(self, tokens: torch.Tensor, cache: KVCache | None, start: int) -> torch.Tensor:
        b, s = tokens.shape
        if start + s > self.spec.max_seq_len:
            raise ValueError(
                f"sequence of {start + s} tokens exceeds max_seq_len={self.spec.max_seq_len}; "
                "raise model.max_seq_len or shorten prompts / max_new_tokens"
            )
        x = self.tok_emb(tokens)
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb.weight[start : start + s]
        else:
            rope = (self.rope_cos[start : start + s], self.rope_sin[start : start + s])
        for i, block in enumerate(self.blocks):
            x = block(x, rope, cache, i, start)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self._trunk(tokens, None, 0)
        if self.has_value_head:
            return self.value_head(h).squeeze(-1)  # [B, L]
        return self.lm_head(h)  # [B, L, V]

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.tok_emb.weight
        shape = (batch, self.spec.n_heads, max_len, self.spec.d_model // self.spec.n_heads)
        n = self.spec.n_layers
        return KVCache(
            keys=[torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(n)],
            values=[torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(n)],
        )

    def forward_cached(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        if self.has_value_head:
            raise TypeError("forward_cached samples tokens; a value-head model (critic) has no logits")
        if start != cache.length:
            raise ValueError(f"cache holds {cache.length} positions but start={start}; feed tokens in order")
        h = self._trunk(tokens, cache, start)
        cache.length = start + tokens.shape[1]
        return self.lm_head(h)
