"""DAPO dynamic sampling: keep only prompt groups whose samples disagree (pure, no I/O).

    >>> f = filter_groups(torch.tensor([1., 1., 0., 1., 0., 0.]), group_size=2)
    >>> f.keep_groups.tolist(), f.keep_samples.tolist(), f.dropped
    ([1], [2, 3], 2)

A group whose samples all got the same reward has GRPO advantage 0 everywhere: it costs a
forward and backward pass and teaches nothing, and it shrinks the effective batch (DAPO, Yu et
al. 2025, section 3.2). Samples of one prompt are contiguous: rows ``[g*G, (g+1)*G)`` are group
``g`` (the built-in rollout's `repeat_interleave` layout).

The `dapo_filter` node (nodes/dapo.py) keeps the running counts, fills the batch back up with the
kept groups of later tickets and drops the tickets it holds with `replace=True`, so the scheduler
asks the source for more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GroupFilter:
    keep_groups: torch.Tensor
    """int64 ``[K]``: indices of the kept groups, ascending."""
    keep_samples: torch.Tensor
    """int64 ``[K*G]``: rows of the kept groups, in order (a batch `select`s these)."""
    kept: int
    dropped: int


def filter_groups(scores: torch.Tensor, group_size: int, min_std: float = 0.0) -> GroupFilter:
    """Drop the groups of ``scores [B]`` whose std (population) is ``<= min_std`` (0: all equal)."""
    scores = torch.as_tensor(scores)
    b = scores.shape[0]
    if group_size < 1 or b % group_size:
        raise ValueError(f"batch of {b} scores does not split into groups of {group_size} "
                         "(samples_per_prompt); the rollout must emit prompts x samples rows")
    s = scores.float().view(b // group_size, group_size)  # [groups, G]
    spread = s.max(dim=1).values - s.min(dim=1).values
    keep = (spread > 0) & (s.std(dim=1, unbiased=False) > min_std)
    groups = keep.nonzero().squeeze(1)
    samples = (groups[:, None] * group_size + torch.arange(group_size)[None]).reshape(-1)
    return GroupFilter(groups, samples, int(keep.sum()), int((~keep).sum()))
