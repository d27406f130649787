"""PPO / GRPO losses and KL estimators: tensors in, a scalar loss and its diagnostics out.

    >>> loss, stats = ppo_policy_loss(logprobs, old_logprobs, adv, mask, clip_low=0.2, clip_high=0.2)
    >>> vloss, vclip = value_loss(values, old_values, returns, mask, clip_range=0.2)
    >>> kl = kl_estimate(logprobs, ref_logprobs, kind="k3")                # [B, T]
    >>> w, keep, st = rollout_importance_weights(old_logprobs, rollout_logprobs, mask, mode="truncate", cap=2.0)
    >>> loss, stats = ppo_policy_loss(logprobs, old_logprobs, adv, keep, is_weights=w)
    >>> mismatch = logprob_mismatch(old_logprobs, rollout_logprobs, mask)   # {"mismatch_logprob_abs_mean": ...}

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
RolloutIS = Literal["off", "truncate", "mask"]


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
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``.

    ``clip_high > clip_low`` is DAPO's "clip higher". ``dual_clip = c > 1`` also bounds the loss of
    negative-advantage tokens by ``-c A`` (Ye et al. 2020), so one very unlikely old token cannot
    dominate. Returns the loss and detached stats: ``clipfrac`` (share of tokens where clipping
    decided the loss) and ``approx_kl`` (k3 estimate of KL(old || new) on the old policy's samples: how far this
    update has drifted).

    ``is_weights [B, T]`` (detached, from :func:`rollout_importance_weights`) multiply each token's
    loss: the correction for a rollout that sampled from a policy other than ``old_logprobs``'.
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
    if is_weights is not None:
        loss = loss * is_weights.detach().to(loss.dtype)
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


def rollout_importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: RolloutIS = "truncate",
    cap: float = 2.0,
    floor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights for samples drawn by the rollout, not by the trainer's ``old`` policy.

    The rollout engine (vLLM, another precision, or weights ``k`` versions old) samples token
    ``y`` with ``pi_rollout(y)``; the PPO ratio is taken against the trainer's own ``pi_old(y)``.
    Each token's ratio ``rho = pi_old / pi_rollout`` corrects the sampling distribution:

    - ``truncate`` (TIS, Yao et al. 2025, "Your efficient RL framework secretly brings you
      off-policy RL training"): weight ``min(rho, cap)``; every token stays in the loss;
    - ``mask`` (masked IS): weight 1 where ``floor <= rho <= cap`` (``floor`` defaults to
      ``1 / cap``), and tokens outside that band are dropped from the loss (``keep`` False: they
      also leave the mean's denominator);
    - ``off``: weight 1, nothing dropped.

    Returns ``(weights [B, T], keep [B, T] bool = mask & kept, stats)``, all detached; ``log rho``
    is clamped to [-20, 20]. Stats: ``rollout_is_ratio_mean``, ``rollout_is_ratio_max`` and the
    share of valid tokens truncated (``rollout_is_truncated_frac``) or masked (``rollout_is_masked_frac``).
    """
    if cap < 1.0:
        raise ValueError(f"importance-sampling cap must be >= 1, got {cap}")
    valid = mask.bool()
    with torch.no_grad():
        rho = torch.exp((old_logprobs.float() - rollout_logprobs.float()).clamp(-20.0, 20.0))
        rho = torch.where(valid, rho, torch.ones_like(rho))
        stats = {"rollout_is_ratio_mean": masked_mean(rho, valid),
                 "rollout_is_ratio_max": rho.masked_fill(~valid, 0.0).max() if valid.any() else torch.ones(())}
        if mode == "off":
            return torch.ones_like(rho), valid, stats
        if mode == "truncate":
            stats["rollout_is_truncated_frac"] = masked_mean((rho > cap).float(), valid)
            return rho.clamp(max=cap), valid, stats
        if mode == "mask":
            low = 1.0 / cap if floor is None else floor
            if not 0 <= low <= 1:
                raise ValueError(f"masked importance sampling floor must be in [0, 1], got {low}")
            inside = (rho >= low) & (rho <= cap)
            stats["rollout_is_masked_frac"] = masked_mean((~inside).float(), valid)
            return torch.ones_like(rho), valid & inside, stats
    raise ValueError(f"unknown rollout importance sampling {mode!r}; use off, truncate or mask")


def logprob_mismatch(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the rollout's log-probs are from the trainer's on the same tokens and weights.

    ``mismatch_logprob_abs_mean`` / ``_abs_max``: mean / max over valid tokens of
    ``|log pi_trainer - log pi_rollout|``; ``mismatch_kl``: the k3 estimate of
    KL(rollout || trainer) on the rollout's own samples. All 0 for a bitwise-equal engine.
    """
    valid = mask.bool()
    with torch.no_grad():
        diff = trainer_logprobs.float() - rollout_logprobs.float()
        absdiff = diff.abs().masked_fill(~valid, 0.0)
        log_r = diff.clamp(-20.0, 20.0)
        return {
            "mismatch_logprob_abs_mean": masked_mean(absdiff, valid),
            "mismatch_logprob_abs_max": absdiff.max() if valid.any() else torch.zeros(()),
            "mismatch_kl": masked_mean(torch.exp(log_r) - 1.0 - log_r, valid),
        }
