"""Packed compute over sequences of their own length: micro-batches by a token budget, per-token
outputs aligned with the tokens, and never a pad token attended to.

    >>> plan_microbatches([5, 300, 12, 40], max_tokens=320)     # indices per micro-batch
    [[0, 1, 2], [3]]
    >>> lp = packed_logprobs(policy, tokens, temperature=1.0, max_tokens=4096)   # Ragged, aligned   # doctest: +SKIP
    >>> v = packed_values(critic, tokens, max_tokens=4096)                       # Ragged, aligned   # doctest: +SKIP

A micro-batch is the concatenation of its sequences' tokens (``[N]``) with their boundaries
(``cu_seqlens [n + 1]``); :func:`forward_packed` computes every position from the tokens of its own
sequence only (block-diagonal causal attention, positions restarting at 0), so a packed micro-batch
gives each sequence what it gets alone. Per-token results are *aligned*: entry ``j`` belongs to token
``j`` and comes from the output at ``j - 1`` (the first token of a sequence gets 0).

A backend with a packed kernel overrides ``CausalLM.forward_packed`` and gets it called. One without
(``CausalLM``'s default runs the sequences one by one) is run on the micro-batch right-padded to its
longest sequence, in ONE call of the model: exact as well (attention is causal, so a real position
never sees the padding after it), and one call is what a sharded (FSDP) model needs -- every rank
makes the same collectives whatever its sequences. Its micro-batches are planned for that
(``padded=True``): runs of similar lengths, the budget bounding the padded positions, so memory
stays bounded by the budget either way.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from flowrl.models.base import CausalLM
from flowrl.transport.ragged import Ragged


def plan_microbatches(lengths: Sequence[int], max_tokens: int | None, *, where: str = "the trainer",
                      padded: bool = False) -> list[list[int]]:
    """Sequence indices of each micro-batch: first-fit decreasing into bins of ``max_tokens`` tokens.

    Deterministic (ties keep index order); inside a micro-batch indices are ascending. ``None``: one
    micro-batch of everything. A sequence longer than the budget is an error naming it and the fix.
    ``padded``: the micro-batches will run right-padded to their longest sequence (a backend without a
    packed kernel), so the budget bounds ``sequences x longest``, and the bins are runs of the lengths
    sorted longest first, cut where they cost least (:func:`_padded_runs`: padding against calls).
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
    if padded:
        return [sorted(b) for b in _padded_runs(order, lengths, max_tokens)]
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


PADDED_CALL_SHARE = 16
"""The padded plan counts one more micro-batch as ``max_tokens / PADDED_CALL_SHARE`` padded positions: the
per-call overhead it weighs against padding (long-tailed lengths: ~3% padding on large batches, ~12%
on a few dozen sequences, about as many micro-batches as first-fit decreasing makes)."""


def _padded_runs(order: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Cut ``order`` (longest first) into runs of at most ``max_tokens`` padded positions (count x first
    length) minimising ``sum(padded positions) + runs x max_tokens / PADDED_CALL_SHARE``, exactly
    (dynamic programme over the cut points, vectorised over the last one)."""
    n = len(order)
    call = max_tokens / PADDED_CALL_SHARE
    sorted_lens = np.array([lengths[i] for i in order], dtype=np.float64)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    start = np.zeros(n + 1, dtype=np.int64)
    for end in range(1, n + 1):
        j = np.arange(end)
        area = (end - j) * sorted_lens[:end]  # the run order[j:end], padded to its first (longest)
        cost = np.where(area <= max_tokens, best[:end] + area + call, np.inf)
        start[end] = int(np.argmin(cost))  # ties: the earliest start, the fewest runs
        best[end] = cost[start[end]]
    runs, end = [], n
    while end > 0:
        runs.append(order[start[end]:end])
        end = int(start[end])
    return runs[::-1]


def cu_seqlens_of(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out


def token_index(offsets: np.ndarray, index: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(take, cu_seqlens)``: where the tokens of samples ``index`` sit in the flat values of a Ragged
    with ``offsets`` (in ``index`` order), and their boundaries once concatenated. Both int64 numpy."""
    index = np.asarray(index, dtype=np.int64)
    starts = offsets[index]
    lens = offsets[index + 1] - starts
    cu = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    take = np.repeat(starts - cu[:-1], lens) + np.arange(int(cu[-1]), dtype=np.int64)
    return take, cu


def shift_to_tokens(out: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-position outputs ``[N, ...]`` -> aligned with tokens: entry j = out[j - 1], 0 at each sequence start."""
    shifted = torch.cat([torch.zeros_like(out[:1]), out[:-1]]) if out.shape[0] else out
    starts = cu_seqlens[:-1][cu_seqlens[:-1] < out.shape[0]]
    return shifted.index_fill(0, starts.to(out.device), 0)


def has_packed_kernel(model) -> bool:
    """Whether ``model``'s class overrides ``CausalLM.forward_packed`` (else :func:`forward_packed` pads)."""
    method = getattr(type(model), "forward_packed", None)
    return method is not None and method is not CausalLM.forward_packed


def forward_packed(model, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` logits (or ``[N]`` values) of packed sequences, each seeing only itself.

    The backend's packed kernel when it has one; else ONE call of the model on the sequences
    right-padded to the longest (exact: causal attention never looks ahead at the padding).
    """
    if has_packed_kernel(model):
        return model.forward_packed(tokens, cu_seqlens)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    width = int(lens.max()) if len(lens) else 0
    real = torch.arange(width, device=tokens.device)[None] < lens[:, None]
    padded = torch.zeros(real.shape, dtype=tokens.dtype, device=tokens.device)
    padded[real] = tokens
    return model(padded)[real]


def dummy_forward(model, device) -> torch.Tensor:
    """The output of a one-token sequence: a pass that joins every collective of a real one (a data-
    parallel rank with fewer micro-batches than the others runs these); ``.sum() * 0`` is its loss."""
    tok = torch.zeros(1, dtype=torch.int64, device=device)
    return forward_packed(model, tok, torch.tensor([0, 1], dtype=torch.int64, device=device))


def aligned_logprobs(logits: torch.Tensor, tokens: torch.Tensor, cu_seqlens: torch.Tensor,
                     temperature: float = 1.0, entropy: bool = False, *, entropy_grad: bool = True):
    """Log-prob of each token ``[N]`` under the packed ``logits [N, V]`` (0 at sequence starts);
    with ``entropy``, also the entropy ``[N]`` of the distribution each token was drawn from
    (``entropy_grad=False``: detached, no backward through it). ``temperature <= 0``: unscaled."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    # the next token of each position; a sequence's last position reads the next sequence's first
    # token, a value the shift below drops (it lands on that sequence's start)
    nxt = torch.cat([tokens[1:], tokens[:1]]) if tokens.shape[0] else tokens
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, nxt.unsqueeze(-1)).squeeze(-1) - lse
    lp = shift_to_tokens(picked, cu_seqlens)
    if not entropy:
        return lp
    src = logits if entropy_grad else logits.detach()
    logp = src - (lse if entropy_grad else lse.detach()).unsqueeze(-1)
    ent = shift_to_tokens(-(logp.exp() * logp).sum(dim=-1), cu_seqlens)
    return lp, ent


def microbatch(tokens: Ragged, index: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat tokens [N], cu_seqlens [n + 1]) of the samples ``index`` of ``tokens``, on ``device``."""
    tokens = tokens.to_torch()
    take, cu = token_index(tokens.offsets.cpu().numpy(), index)
    values = tokens.values
    return values[torch.from_numpy(take).to(values.device)].to(device), torch.from_numpy(cu).to(device)


@torch.no_grad()
def packed_logprobs(model, tokens: Ragged, *, temperature: float = 1.0, max_tokens: int | None = None,
                    where: str = "the model", passes: Callable[[int], int] | None = None) -> Ragged:
    """Aligned log-probs (float32 Ragged, on the CPU) of every token of ``tokens`` under ``model``, packed.

    ``passes``: ``n_microbatches -> n_passes`` (a data-parallel trainer's max over its ranks); the
    passes beyond this rank's micro-batches are one-token dummies, so every rank runs as many.
    """
    return _packed(model, tokens, max_tokens, where, passes,
                   lambda out, tok, cu: aligned_logprobs(out, tok, cu, temperature))


@torch.no_grad()
def packed_values(model, tokens: Ragged, *, max_tokens: int | None = None, where: str = "the critic",
                  passes: Callable[[int], int] | None = None) -> Ragged:
    """Aligned values (float32 Ragged, on the CPU): entry j = V(state before token j), from a value-head model."""
    if not model.has_value_head:
        raise TypeError("values need a critic: build the model with value_head=True")
    return _packed(model, tokens, max_tokens, where, passes, lambda out, tok, cu: shift_to_tokens(out.float(), cu))


def nonempty_plan(lengths: np.ndarray, max_tokens: int | None, where: str, model=None) -> list[list[int]]:
    """:func:`plan_microbatches` for ``model`` (padded bins when it has no packed kernel), without the
    sequences of no tokens (nothing to compute) or empty bins."""
    padded = model is not None and not has_packed_kernel(model)
    plan = plan_microbatches(lengths.tolist(), max_tokens, where=where, padded=padded)
    return [b for b in ([i for i in b if lengths[i]] for b in plan) if b]


def _packed(model, tokens: Ragged, max_tokens, where, passes, per_token) -> Ragged:
    tokens = tokens.to_torch()
    device = next(model.parameters()).device
    offsets = tokens.offsets.cpu().numpy()
    plan = nonempty_plan(np.diff(offsets), max_tokens, where, model)
    out = torch.zeros(tokens.total, dtype=torch.float32)
    values = tokens.values.to(device)
    for k in range(passes(len(plan)) if passes is not None else len(plan)):
        if k >= len(plan):
            dummy_forward(model, device)
            continue
        take, cu = token_index(offsets, plan[k])
        take_t = torch.from_numpy(take)
        tok, cu_t = values[take_t.to(device)], torch.from_numpy(cu).to(device)
        out[take_t] = per_token(forward_packed(model, tok, cu_t), tok, cu_t).float().cpu()
    return tokens.like(out)
