"""The interface every model backend implements, so sampling, log-probs and values are written once.

A backend (the built-in :mod:`flowrl.models.tiny`, the Hugging Face adapter :mod:`flowrl.models.hf`)
is an ``nn.Module`` with three methods:

- ``forward(tokens [B, L]) -> [B, L, V]`` logits of a policy, or ``[B, L]`` values of a critic
  (``has_value_head``): output ``i`` is computed from ``tokens[:, :i + 1]``;
- ``new_cache(batch, max_len)`` -> an opaque KV cache for incremental decoding;
- ``forward_cached(tokens [B, S], cache, start) -> [B, S, V]`` logits of ``S`` new tokens at
  positions ``start .. start + S - 1``, appending their keys and values to ``cache``.

Inputs are never padded on the left: all prompts of a batch have the same length (the built-in
tasks guarantee it), and padding after a response's EOS only affects positions that are masked out
anyway, so no attention mask is needed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


class CausalLM(nn.Module, ABC):
    """Base class of the model backends; see the module docstring for the contract."""

    has_value_head: bool = False
    vocab_size: int

    @abstractmethod
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, L, V]`` (policy) or values ``[B, L]`` (critic) for every position."""

    def forward_packed(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Outputs ``[N, V]`` (or values ``[N]``) of packed sequences: ``tokens [N]`` holds sequence
        ``i`` at ``cu_seqlens[i]:cu_seqlens[i + 1]``; each position sees only its own sequence, and
        positions restart at 0 for each. This default runs the sequences one at a time (exact for
        any backend); backends override it with a real packed kernel."""
        outs = [self.forward(tokens[int(a):int(b)][None])[0]
                for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()) if b > a]
        if not outs:
            return self.forward(tokens[:1][None])[0][:0] if len(tokens) else torch.zeros(0)
        return torch.cat(outs)

    @abstractmethod
    def new_cache(self, batch: int, max_len: int) -> Any:
        """An empty KV cache for ``batch`` sequences of at most ``max_len`` tokens."""

    @abstractmethod
    def forward_cached(self, tokens: torch.Tensor, cache: Any, start: int) -> torch.Tensor:
        """Logits ``[B, S, V]`` of tokens at positions ``start..start+S-1``; extends ``cache``."""
