"""Reductions over the valid tokens of a padded batch.

Every RL quantity lives on a ``[B, T]`` grid where ``mask`` (bool or 0/1 float) marks the response
tokens up to and including EOS; padding must never move a mean, a variance or a gradient.
"""

from __future__ import annotations

from typing import Callable

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set (over ``dim``, or everything)."""
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the masked entries; 0 where nothing is masked in (never NaN)."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1.0)
    return (x * m).sum(dim=dim) / m.sum(dim=dim).clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all masked entries (Bessel-corrected when ``unbiased``)."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1.0)
    sq = (((x - mean) ** 2) * m).sum()
    if unbiased:
        return sq / (n - 1).clamp(min=1.0)
    return sq / n.clamp(min=1.0)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
    all_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``(x - mean) / std`` over the masked entries; ``shift_mean=False`` keeps the mean.

    Masked-out entries come back as 0, so later sums need no second masking. ``all_sum``: a data-
    parallel trainer's sum over its ranks (``trainer.dp.all_sum``), so that mean and std are those
    of every rank's entries together (one all-reduce of three numbers, in float64).
    """
    m = mask.to(x.dtype)
    if all_sum is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        xd, md = x.double(), m.double()
        n, s1, s2 = all_sum(torch.stack([md.sum(), (xd * md).sum(), (xd * xd * md).sum()]).cpu()).tolist()
        mean_d = s1 / max(n, 1.0)
        mean = torch.tensor(mean_d, dtype=x.dtype, device=x.device)
        var = torch.tensor(max(s2 - n * mean_d * mean_d, 0.0) / max(n - 1.0, 1.0), dtype=x.dtype, device=x.device)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * m
