"""PPO / GRPO losses and KL estimators: tensors in, a scalar loss and its diagnostics out.

    >>> loss, stats = ppo_policy_loss(logprobs, old_logprobs, adv, mask, clip_low=0.2, clip_high=0.2)
    >>> vloss, vclip = value_loss(values, old_values, returns, mask, clip_range=0.2)
    >>> kl = kl_estimate(logprobs, ref_logprobs, kind="k3")                # [B, T]
    >>> w, keep, st = rollout_importance_weights(old_logprobs, rollout_logprobs, mask, mode="truncate", cap=2.0)
    >>> loss, stats = ppo_policy_loss(logprobs, old_logprobs, adv, keep, is_weights=w)
    >>> mismatch = logprob_mismatch(old_logprobs, rollout_logprobs, mask)   # {"mismatch_logprob_abs_mean": ...}

Shapes are ``[B, T]`` over response tokens with a validity ``mask``, or flat ``[N]`` per-token
tensors of packed sequences (the trainers). How per-token losses ``l_it`` (sequence ``i`` of the
mini-batch's ``S`` sequences, valid token ``t`` of its ``T_i``) become one number is ``mode``:

- ``token_mean``: ``sum_i sum_t l_it / sum_i T_i`` -- every valid token of the mini-batch weighs the
  same (DAPO's "token-level policy gradient loss", Yu et al. 2025, eq. 8; verl's default), so long
  answers are not under-weighted;
- ``seq_mean_token_mean``: ``(1/S) sum_i (1/T_i) sum_t l_it`` -- the original GRPO (Shao et al.
  2024): each sequence weighs the same, its tokens share its weight (DAPO's criticism: a long
  answer's tokens count less);
- ``seq_mean_token_sum``: ``(1/S) sum_i sum_t l_it`` -- per-sequence sums, averaged over sequences;
- ``seq_mean_token_sum_norm``: ``(1/S) sum_i sum_t l_it / L`` with a constant ``L``
  (``loss_agg_norm_len``) -- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"):
  the ``1/T_i`` length normalisation is replaced by one constant (the generation budget), removing
  GRPO's length bias without changing the scale from batch to batch.

``S`` counts every sequence of the mini-batch (one whose tokens are all masked out too). The
trainers split a mini-batch into micro-batches and over data-parallel ranks; :func:`loss_weights`
gives each token its weight from the mini-batch's GLOBAL ``sum_i T_i`` and ``S`` (all micro-batches,
all ranks), so ``sum(weights * loss)`` over any split adds up to the aggregate of the whole
mini-batch.
"""

from __future__ import annotations

from typing import Literal

import torch

from flowrl.rl.masked import masked_mean, masked_sum

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
KLKind = Literal["k1", "k2", "k3"]
RolloutIS = Literal["off", "truncate", "mask"]


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: LossAgg = "token_mean",
              norm_len: int | None = None) -> torch.Tensor:
    """Per-token ``[B, T]`` -> scalar, over valid tokens only (see the module docstring).

    ``norm_len``: the constant of ``seq_mean_token_sum_norm`` (default: ``T``, the grid's width).
    """
    if mode == "token_mean":
        return masked_mean(loss, mask)
    if mode == "seq_mean_token_mean":
        return masked_mean(loss, mask, dim=1).mean()
    if mode == "seq_mean_token_sum":
        return masked_sum(loss, mask, dim=1).mean()
    if mode == "seq_mean_token_sum_norm":
        return masked_sum(loss, mask, dim=1).mean() / float(norm_len or mask.shape[-1])
    raise ValueError(f"unknown loss aggregation {mode!r}; use token_mean, seq_mean_token_mean, seq_mean_token_sum "
                     "or seq_mean_token_sum_norm")


def loss_weights(mask: torch.Tensor, seq_tokens: torch.Tensor, mode: LossAgg, *, tokens: float, sequences: float,
                 norm_len: int | None = None) -> torch.Tensor:
    """Per-token weights ``[N]`` such that ``(weights * loss).sum()`` is this token's share of ``mode``'s aggregate.

    ``mask [N]``: the valid tokens; ``seq_tokens [N]``: how many valid tokens the sequence of each
    token has (``T_i``); ``tokens`` / ``sequences``: the mini-batch's totals ``sum_i T_i`` and ``S``
    over every micro-batch and rank. Summed over any split of the mini-batch the weighted losses give
    exactly :func:`aggregate` of the whole of it.
    """
    m = mask.to(torch.float32)
    if mode == "token_mean":
        return m / max(float(tokens), 1.0)
    if mode == "seq_mean_token_mean":
        return m / (seq_tokens.to(torch.float32).clamp(min=1.0) * max(float(sequences), 1.0))
    if mode == "seq_mean_token_sum":
        return m / max(float(sequences), 1.0)
    if mode == "seq_mean_token_sum_norm":
        if not norm_len:
            raise ValueError("loss_agg=seq_mean_token_sum_norm needs loss_agg_norm_len (a constant, e.g. the "
                             "rollout's max_new_tokens)")
        return m / (max(float(sequences), 1.0) * float(norm_len))
    raise ValueError(f"unknown loss aggregation {mode!r}; use token_mean, seq_mean_token_mean, seq_mean_token_sum "
                     "or seq_mean_token_sum_norm")


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
    loss, clipped, ratio, log_ratio = ppo_token_loss(logprobs, old_logprobs, advantages, clip_low=clip_low,
                                                     clip_high=clip_high, dual_clip=dual_clip, is_weights=is_weights)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(clipped.float(), mask),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return aggregate(loss, mask, agg), stats


def ppo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ppo_policy_loss` per token, not aggregated: ``(loss, clipped, ratio, log_ratio)`` of any shape.

    ``clipped`` (bool), ``ratio`` and ``log_ratio`` are detached (the statistics' inputs).
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
    return loss, (clipped > unclipped).detach(), ratio.detach(), log_ratio.detach()


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
    loss, clipped = value_token_loss(values, old_values, returns, clip_range=clip_range)
    if clip_range is None:
        return aggregate(loss, mask, agg), torch.zeros(())
    with torch.no_grad():
        clipfrac = masked_mean(clipped.float(), mask)
    return aggregate(loss, mask, agg), clipfrac


def value_token_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *,
                     clip_range: float | None = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`value_loss` per token, not aggregated: ``(0.5 * max(err, err_clip), clipped)`` of any shape."""
    err = (values - returns) ** 2
    if clip_range is None:
        return 0.5 * err, torch.zeros_like(err, dtype=torch.bool)
    v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
    err_clip = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(err, err_clip), (err_clip > err).detach()


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
