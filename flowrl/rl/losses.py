"""PPO / GRPO losses and KL estimators: tensors in, a scalar loss and its diagnostics out.

    >>> loss, stats = ppo_policy_loss(logprobs, old_logprobs, adv, mask, clip_low=0.2, clip_high=0.2)
    >>> vloss, vclip = value_loss(values, old_values, returns, mask, clip_range=0.2)
    >>> kl = kl_estimate(logprobs, ref_logprobs, kind="k3")                # [B, T]

Shapes are ``[B, T]`` over response tokens with a validity ``mask``. How per-token losses become
one number is :func:`aggregate`'s ``mode``:

- ``token_mean``: mean over every valid token of the batch (long answers weigh more; verl's
  default, and DAPO's recommendation);
- ``seq_mean_token_mean``: mean per sequence, then over sequences (the original GRPO);
- ``seq_mean_token_sum``: sum per sequence, mean over sequences.
"""

from __future__ import annotations

from typing import Literal

import torch

from flowrl.rl.masked import masked_mean, masked_sum

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLKind = Literal["k1", "k2", "k3"]


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: LossAgg = "token_mean") -> torch.Tensor:
    """Per-token ``[B, T]`` -> scalar, over valid tokens only (see the module docstring)."""
    if mode == "token_mean":
        return masked_mean(loss, mask)
    if mode == "seq_mean_token_mean":
        return masked_mean(loss, mask, dim=1).mean()
    if mode == "seq_mean_token_sum":
        return masked_sum(loss, mask, dim=1).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; use token_mean, seq_mean_token_mean or seq_mean_token_sum")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs.

    With ``log r = ref_logprobs - logprobs`` (Schulman, "Approximating KL divergence"):
    ``k1 = -log r`` (unbiased, can be negative), ``k2 = (log r)^2 / 2`` (low variance, biased),
    ``k3 = r - 1 - log r`` (unbiased, always >= 0; GRPO's KL loss). ``k3`` is computed with
    ``log r`` clamped to [-20, 20] so a far-off token cannot overflow ``exp``.
    """
    log_ratio = ref_logprobs.float() - logprobs.float()
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: LossAgg = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``.

    ``clip_high > clip_low`` is DAPO's "clip higher". ``dual_clip = c > 1`` also bounds the loss of
    negative-advantage tokens by ``-c A`` (Ye et al. 2020), so one very unlikely old token cannot
    dominate. Returns the loss and detached stats: ``clipfrac`` (share of tokens where clipping
    decided the loss) and ``approx_kl`` (k3 estimate of KL(old || new) on the old policy's samples: how far this
    update has drifted).
    """
    log_ratio = (logprobs - old_logprobs.float()).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return aggregate(loss, mask, agg), stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float | None = 0.2,
    agg: LossAgg = "token_mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss ``0.5 max((V - R)^2, (V_clip - R)^2)``, ``V_clip = V_old + clip(V - V_old, +-c)``.

    ``clip_range=None`` is the plain squared error. Returns the loss and the (detached) fraction
    of tokens where the clipped term was the larger one.
    """
    err = (values - returns) ** 2
    if clip_range is None:
        return 0.5 * aggregate(err, mask, agg), torch.zeros(())
    v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
    err_clip = (v_clip - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(err, err_clip), mask, agg)
    with torch.no_grad():
        clipfrac = masked_mean((err_clip > err).float(), mask)
    return loss, clipfrac


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, agg: LossAgg = "token_mean") -> torch.Tensor:
    """Mean entropy of the valid tokens (subtract ``coef *`` this from the loss to encourage exploring)."""
    return aggregate(entropy, mask, agg)
