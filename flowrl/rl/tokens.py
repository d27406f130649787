"""Per-token data of sequences of their own length, as the trainers and the advantages use it.

    tokens, loss_mask, f = rect_to_ragged(tokens, prompt_len, response_mask, old_logprobs=lp)   # legacy grids in
    grid, gmask = to_grid(values, loss_mask)   # each sequence's loss-masked tokens, right-padded: [B, T]
    back = from_grid(grid, loss_mask)          # Ragged aligned with loss_mask again (0 off the mask)
    rect = to_rect(values, prompt_len, T)      # aligned Ragged -> the [B, T] response grid of a legacy caller
    batch = TokenBatch(tokens, device, {"mask": loss_mask.values, ...})
    mb = batch.take([3, 0, 5])                 # one micro-batch: flat tokens, cu_seqlens, its fields

Aligned (see ``flowrl.models.generation``): a per-token tensor has entry ``j`` for token ``j`` of
its sequence, computed from the model output at ``j - 1``; entry 0 of a sequence is never in a loss
mask. A legacy ``[B, P + T]`` batch with ``[B, T]`` response grids maps onto this one for one: row
``b`` becomes a sequence of ``P + t_b`` tokens (``t_b``: one past its last masked response position;
the padding after it is dropped), response entry ``t`` becomes aligned entry ``P + t``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from flowrl.models.packing import token_index
from flowrl.transport.ragged import Ragged


def rect_to_ragged(tokens: torch.Tensor, prompt_len: int, response_mask: torch.Tensor,
                   **grids: Any) -> tuple[Ragged, Ragged, dict[str, Any]]:
    """A legacy batch as ragged ``(tokens, loss_mask, fields)``: each ``[B, T]`` grid of ``grids``
    becomes a Ragged aligned with the tokens; ``[B]`` tensors and None come back as they are."""
    b, width = tokens.shape
    t = width - int(prompt_len)
    if not 0 < prompt_len < width or tuple(response_mask.shape) != (b, t):
        raise ValueError(f"tokens {tuple(tokens.shape)} with prompt_len={prompt_len} need a [{b}, {t}] response_mask, "
                         f"got {tuple(response_mask.shape)}")
    mask = response_mask.detach().bool().cpu()
    keep = torch.where(mask, torch.arange(1, t + 1)[None], 0).amax(dim=1) if t else torch.zeros(b, dtype=torch.long)
    lens = keep + int(prompt_len)
    ragged = Ragged.from_padded(tokens.detach().cpu(), lens)

    def aligned(grid: torch.Tensor) -> Ragged:
        return grid_to_aligned(grid, prompt_len, ragged)

    out = {}
    for name, g in grids.items():
        if g is not None and g.dim() == 2:
            if tuple(g.shape) != (b, t):
                raise ValueError(f"{name} must be [{b}, {t}] like response_mask, got {tuple(g.shape)}")
            out[name] = aligned(g)
        else:
            out[name] = g
    return ragged, aligned(mask), out


def grid_to_aligned(grid: torch.Tensor, prompt_len: int, tokens: Ragged) -> Ragged:
    """A legacy ``[B, T]`` response grid as a Ragged aligned with ``tokens`` (as `rect_to_ragged` cut
    them): response entry ``t`` at aligned entry ``prompt_len + t``, 0 on the prompt."""
    grid = grid.detach().cpu()
    full = torch.cat([torch.zeros(grid.shape[0], int(prompt_len), dtype=grid.dtype), grid], dim=1)
    return tokens.like(Ragged.from_padded(full, tokens.lengths.cpu()).values)


def to_rect(values: Ragged, prompt_len: int, width: int) -> torch.Tensor:
    """``[B, width]``: the response part (aligned entries ``prompt_len ..``) of each sequence, then 0."""
    return values.to_torch().to_padded(0, width=int(prompt_len) + int(width))[:, int(prompt_len):]


def _grid_index(mask: Ragged) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(flat mask [N], row and column of each masked token, rows, columns) of the compacted grid."""
    mask = mask.to_torch()
    m = mask.values.bool()
    seq = mask.sample_ids()
    counts = torch.zeros(mask.num_samples, dtype=torch.int64, device=m.device).index_add_(0, seq, m.long())
    before = torch.cumsum(counts, 0) - counts  # masked tokens of the earlier sequences
    col = torch.cumsum(m.long(), 0) - 1 - before[seq]
    width = max(int(counts.max()) if len(counts) else 0, 1)
    return m, seq[m], col[m], mask.num_samples, width


def to_grid(values: Ragged | torch.Tensor, mask: Ragged) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grid [B, T], grid_mask [B, T])``: row ``i`` holds sequence ``i``'s values at its masked tokens,
    in order, right-padded with 0 (``T``: the most masked tokens of a sequence). A loss mask with
    holes (multi-turn: tool output between turns) closes up: what GAE needs, a step per action."""
    m, rows, cols, n, width = _grid_index(mask)
    flat = values.to_torch().values if isinstance(values, Ragged) else values
    grid = torch.zeros((n, width), dtype=flat.dtype, device=flat.device)
    grid[rows, cols] = flat[m]
    gmask = torch.zeros((n, width), dtype=torch.bool, device=flat.device)
    gmask[rows, cols] = True
    return grid, gmask


def from_grid(grid: torch.Tensor, mask: Ragged) -> Ragged:
    """The inverse of :func:`to_grid`: a Ragged aligned with ``mask``, ``grid``'s values at its masked
    tokens, 0 elsewhere."""
    m, rows, cols, _, _ = _grid_index(mask)
    out = torch.zeros(m.shape[0], dtype=grid.dtype, device=grid.device)
    out[m] = grid[rows, cols]
    return mask.to_torch().like(out)


def seq_values_to_tokens(seq_values: torch.Tensor, tokens: Ragged) -> torch.Tensor:
    """``[B]`` per-sequence values -> ``[N]``: each token gets its sequence's value."""
    if seq_values.shape[0] != tokens.num_samples:
        raise ValueError(f"{seq_values.shape[0]} per-sequence values for {tokens.num_samples} sequences")
    return seq_values[tokens.to_torch().sample_ids().to(seq_values.device)]


def flat_aligned(name: str, x: Ragged, tokens: Ragged) -> torch.Tensor:
    """``x``'s flat values, after checking that ``x`` is aligned with ``tokens`` (the error names it)."""
    if not isinstance(x, Ragged):
        raise TypeError(f"{name} must be a Ragged aligned with tokens, got {type(x).__name__}")
    if not tokens.aligned(x):
        raise ValueError(f"{name} is not aligned with tokens: its sequences have {x.lengths.tolist()[:8]} entries, "
                         f"the tokens' {tokens.lengths.tolist()[:8]}; give one entry per token (0 where unused)")
    return x.to_torch().values


class MicroBatch(NamedTuple):
    tokens: torch.Tensor
    """``[N]`` the micro-batch's tokens, its sequences one after another."""
    cu_seqlens: torch.Tensor
    """``[n + 1]`` their boundaries."""
    seq: torch.Tensor
    """``[N]`` the batch's sequence index of each token."""
    fields: dict[str, torch.Tensor]
    """Each per-token field of the batch, for these tokens."""


class TokenBatch:
    """One batch's tokens and per-token fields, flat and on the trainer's device, cut into micro-batches."""

    def __init__(self, tokens: Ragged, device: torch.device, fields: dict[str, torch.Tensor | None]) -> None:
        tokens = tokens.to_torch()
        self.offsets = tokens.offsets.cpu().numpy()
        self.lengths = np.diff(self.offsets)
        self.tokens = tokens.values.to(device)
        self.fields = {k: v.to(device) for k, v in fields.items() if v is not None}
        self.seq = torch.from_numpy(np.repeat(np.arange(len(self.lengths)), self.lengths)).to(device)

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]

    def seq_sums(self, x: torch.Tensor) -> torch.Tensor:
        """``[B]`` float64: the sum of per-token ``x [N]`` over each sequence's tokens."""
        out = torch.zeros(self.num_sequences, dtype=torch.float64, device=x.device)
        return out.index_add_(0, self.seq.to(x.device), x.double())

    def take(self, index: list[int]) -> MicroBatch:
        """The sequences ``index`` (batch positions) as one packed micro-batch."""
        take, cu = token_index(self.offsets, index)
        t = torch.from_numpy(take).to(self.tokens.device)
        return MicroBatch(self.tokens[t], torch.from_numpy(cu).to(self.tokens.device), self.seq[t],
                          {k: v[t] for k, v in self.fields.items()})
