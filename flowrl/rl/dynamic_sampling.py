"""DAPO dynamic sampling: keep only prompt groups whose samples disagree (pure, no I/O).

    >>> f = filter_groups(torch.tensor([1., 1., 0., 1., 0., 0.]), group_size=2)
    >>> f.keep_groups.tolist(), f.keep_samples.tolist(), f.dropped
    ([1], [2, 3], 2)

A group whose samples all got the same reward has GRPO advantage 0 everywhere: it costs a
forward and backward pass and teaches nothing, and it shrinks the effective batch (DAPO, Yu et
al. 2025, section 3.2). Samples of one prompt are contiguous: rows ``[g*G, (g+1)*G)`` are group
``g`` (the built-in rollout's `repeat_interleave` layout).

:class:`DynamicSampling` keeps the running counts and says how many groups a batch still lacks
(`need`). The `dapo_filter` node fills the batch back up with the kept groups of later tickets
and drops the tickets it holds with `replace=True`, so the scheduler asks the source for more.
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


class DynamicSampling:
    """Counts over a run, and the shortfall of each batch against a target number of groups."""

    def __init__(self, target_groups: int | None = None, min_std: float = 0.0):
        self.target_groups, self.min_std = target_groups, min_std
        self.seen = self.kept = self.dropped = self.empty_batches = 0

    def __call__(self, scores: torch.Tensor, group_size: int) -> tuple[GroupFilter, int]:
        """The filter of one batch and `need`: groups missing to reach the target (the batch's own
        group count when no target is set)."""
        f = filter_groups(scores, group_size, self.min_std)
        self.seen += f.kept + f.dropped
        self.kept += f.kept
        self.dropped += f.dropped
        self.empty_batches += f.kept == 0
        target = self.target_groups if self.target_groups is not None else f.kept + f.dropped
        return f, max(0, target - f.kept)
