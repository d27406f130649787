"""Packed compute over sequences of their own length: micro-batches by a token budget, per-token
outputs aligned with the tokens, and never a pad token attended to.

    >>> plan_microbatches([5, 300, 12, 40], max_tokens=320)     # indices per micro-batch
    [[0, 1, 2], [3]]
    >>> lp = packed_logprobs(policy, tokens, temperature=1.0, max_tokens=4096)   # Ragged, aligned   # doctest: +SKIP
    >>> v = packed_values(critic, tokens, max_tokens=4096)                       # Ragged, aligned   # doctest: +SKIP

A micro-batch is the concatenation of its sequences' tokens (``[N]``) with their boundaries
(``cu_seqlens [n + 1]``); ``model.forward_packed`` computes every position from the tokens of its own
sequence only (block-diagonal causal attention, positions restarting at 0), so a packed micro-batch
gives each sequence what it gets alone. Per-token results are *aligned*: entry ``j`` belongs to token
``j`` and comes from the output at ``j - 1`` (the first token of a sequence gets 0).
"""

from __future__ import annotations

from typing import Sequence

import torch

from flowrl.transport.ragged import Ragged


def plan_microbatches(lengths: Sequence[int], max_tokens: int | None, *, where: str = "the trainer") -> list[list[int]]:
    """Sequence indices of each micro-batch: first-fit decreasing into bins of ``max_tokens`` tokens.

    Deterministic (ties keep index order); inside a micro-batch indices are ascending. ``None``: one
    micro-batch of everything. A sequence longer than the budget is an error naming it and the fix.
    """
    lengths = [int(x) for x in lengths]
    if max_tokens is None:
        return [list(range(len(lengths)))] if lengths else []
    if max_tokens < 1:
        raise ValueError(f"{where}: max_tokens_per_microbatch must be >= 1, got {max_tokens}")
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"{where}: sequence {i} has {n} tokens, more than max_tokens_per_microbatch="
                             f"{max_tokens}; raise max_tokens_per_microbatch to at least {n} (or lower the "
                             "prompt / response length caps)")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def cu_seqlens_of(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out


def shift_to_tokens(out: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-position outputs ``[N, ...]`` -> aligned with tokens: entry j = out[j - 1], 0 at each sequence start."""
    shifted = torch.zeros_like(out)
    shifted[1:] = out[:-1]
    starts = cu_seqlens[:-1][cu_seqlens[:-1] < out.shape[0]]
    shifted[starts] = 0
    return shifted


def aligned_logprobs(logits: torch.Tensor, tokens: torch.Tensor, cu_seqlens: torch.Tensor,
                     temperature: float = 1.0, entropy: bool = False):
    """Log-prob of each token ``[N]`` under the packed ``logits [N, V]`` (0 at sequence starts);
    with ``entropy``, also the entropy ``[N]`` of the distribution each token was drawn from."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    nxt = torch.zeros_like(tokens)
    nxt[:-1] = tokens[1:]
    lp = shift_to_tokens(logp_all.gather(-1, nxt.unsqueeze(-1)).squeeze(-1), cu_seqlens)
    if not entropy:
        return lp
    ent = shift_to_tokens(-(logp_all.exp() * logp_all).sum(dim=-1), cu_seqlens)
    return lp, ent


def microbatch(tokens: Ragged, index: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat tokens [N], cu_seqlens [n + 1]) of the samples ``index`` of ``tokens``, on ``device``."""
    part = tokens.select(torch.as_tensor(index, dtype=torch.int64).numpy())
    return part.values.to(device), part.offsets.to(device)


@torch.no_grad()
def packed_logprobs(model, tokens: Ragged, *, temperature: float = 1.0, max_tokens: int | None = None,
                    where: str = "the model") -> Ragged:
    """Aligned log-probs (float32 Ragged) of every token of ``tokens`` under ``model``, packed."""
    return _packed(model, tokens, max_tokens, where,
                   lambda out, tok, cu: aligned_logprobs(out, tok, cu, temperature))


@torch.no_grad()
def packed_values(model, tokens: Ragged, *, max_tokens: int | None = None, where: str = "the critic") -> Ragged:
    """Aligned values (float32 Ragged): entry j = V(state before token j), from a value-head model."""
    if not model.has_value_head:
        raise TypeError("values need a critic: build the model with value_head=True")
    return _packed(model, tokens, max_tokens, where, lambda out, tok, cu: shift_to_tokens(out.float(), cu))


def _packed(model, tokens: Ragged, max_tokens, where, per_token) -> Ragged:
    tokens = tokens.to_torch()
    device = next(model.parameters()).device
    out = torch.zeros(tokens.total, dtype=torch.float32)
    starts = tokens.offsets
    for index in plan_microbatches(tokens.lengths.tolist(), max_tokens, where=where):
        tok, cu = microbatch(tokens, index, device)
        got = per_token(model.forward_packed(tok, cu), tok, cu).float().cpu()
        # scatter back: sample i's tokens sit at starts[i] .. starts[i+1]
        idx = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in index]) if index else \
            torch.zeros(0, dtype=torch.int64)
        out[idx] = got
    return tokens.like(out)
