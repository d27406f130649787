"""The interface every model backend implements, so sampling, log-probs and values are written once.

A backend (the built-in :mod:`flowrl.models.tiny`, the Hugging Face adapter :mod:`flowrl.models.hf`)
is an ``nn.Module`` with four methods:

- ``forward(tokens [B, L], attention_mask=None, position_ids=None) -> [B, L, V]`` logits of a
  policy, or ``[B, L]`` values of a critic (``has_value_head``): output ``i`` is computed from the
  real tokens among ``tokens[:, :i + 1]``;
- ``forward_packed(tokens [N], cu_seqlens [n + 1]) -> [N, V]`` (or ``[N]``): sequences of their own
  length, concatenated, each computed as if alone (positions restart at 0, no pad anywhere);
- ``new_cache(batch, max_len)`` -> an opaque KV cache for incremental decoding;
- ``forward_cached(tokens [B, S], cache, start, attention_mask=None, position_ids=None) -> [B, S, V]``
  logits of ``S`` new tokens in cache slots ``start .. start + S - 1``, appending their keys and
  values to ``cache``.

Padding is explicit and never attended to. ``attention_mask`` (bool or 0/1, True on real tokens)
marks pads: no query attends to a pad key, and a pad query attends at least to itself so no NaN
ever appears (a NaN at a discarded pad would still reach real positions through ``0 * NaN``).
Positions default to the number of real tokens before each token (:func:`default_positions`), so
a left-padded row computes exactly what it computes alone. The cache remembers which slots are pads,
which is how :func:`flowrl.models.sampling.generate` decodes prompts of different lengths together:
left-padded, each row gets what it gets alone, whatever the pad ids. Right padding needs no mask for
the real positions (causal attention never looks ahead), only for whatever reads the pad positions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


def default_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions ``[B, L]`` int64 for a padded batch: the real tokens before each one (a left-padded
    row starts at 0 on its first real token; pads take the position of the next or last real one)."""
    return (attention_mask.to(torch.int64).cumsum(dim=-1) - 1).clamp(min=0)


class CausalLM(nn.Module, ABC):
    """Base class of the model backends; see the module docstring for the contract."""

    has_value_head: bool = False
    vocab_size: int

    @abstractmethod
    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, L, V]`` (policy) or values ``[B, L]`` (critic) for every position; pads
        (``attention_mask`` False) are never attended to by any other position."""

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
        """An empty KV cache for ``batch`` sequences of at most ``max_len`` slots (pads included)."""

    @abstractmethod
    def forward_cached(self, tokens: torch.Tensor, cache: Any, start: int, attention_mask: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, S, V]`` of tokens in slots ``start..start+S-1``; extends ``cache``. Slots whose
        ``attention_mask`` is False are pads, never attended to by this or any later call; positions
        default to each row's count of real tokens so far."""
