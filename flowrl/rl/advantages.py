"""Advantages: GAE for PPO (with a critic), group-normalised scores for GRPO (without one).

    >>> rewards = token_rewards(scores, mask, kl=kl, kl_coef=0.05)     # [B, T]
    >>> adv, returns = gae(rewards, values, mask, gamma=1.0, lam=0.95)  # [B, T] each
    >>> adv = group_advantages(scores, group_size=8)                    # [B], one per sequence
    >>> adv, returns = compute_advantages(AdvantageConfig(), scores=scores, mask=mask, values=values)

Sequences of their own length (``Ragged`` per-token tensors aligned with the tokens, see
docs/packing.md) have the same functions in ragged form:

    >>> adv, returns = ppo_advantages_ragged(scores, values, loss_mask, gamma=1.0, lam=0.95)  # Ragged each
    >>> adv = broadcast_to_tokens_ragged(group_advantages(scores, 8), loss_mask)                # Ragged

They gather each sequence's loss-masked tokens into a right-padded ``[B, T]`` grid
(``flowrl.rl.tokens.to_grid``), run the grid function, and scatter back (``from_grid``): a loss
mask with holes (multi-turn: tool output between the model's turns) is one episode of the masked
tokens, in order. ``compute_advantages`` takes either form.

Pure tensor functions, no gradients: the callers pass detached values.
"""

from __future__ import annotations

from typing import Callable

import torch

from flowrl.rl.config import AdvantageConfig
from flowrl.rl.losses import kl_estimate
from flowrl.rl.masked import masked_whiten
from flowrl.rl.tokens import flat_aligned, from_grid, to_grid
from flowrl.transport.ragged import Ragged


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index ``[B]`` of the last masked token of each row (0 for an empty row)."""
    t = mask.shape[1]
    pos = torch.arange(t, device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), pos, 0).amax(dim=1)


@torch.no_grad()
def token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards ``[B, T]``: the sequence score on its last token, minus ``kl_coef * kl`` on every token.

    This is the KL *penalty in the reward* of InstructGPT-style PPO; ``kl`` is a per-token estimate
    such as :func:`flowrl.rl.losses.kl_estimate` of policy vs reference. Padding gets 0.
    """
    m = mask.to(torch.float32)
    rewards = torch.zeros_like(m)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl.float() * m
    rows = torch.arange(mask.shape[0], device=mask.device)
    has_token = mask.bool().any(dim=1)
    rewards[rows, last_token_index(mask)] += torch.where(has_token, scores.float(), 0.0)
    return rewards


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over ``[B, T]``; returns ``(advantages, returns)``.

    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``, with the value
    after a row's last valid token taken as 0 (the episode ends there); ``returns = A + V`` are the
    critic's targets. Padding gets 0 in both. The loop runs over ``T`` (a few dozen steps), not
    over the batch.
    """
    m = mask.to(torch.float32)
    r, v = rewards.float() * m, values.float() * m
    t_len = r.shape[1]
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(t_len)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        # a padded step passes the future through unchanged (it is not part of the episode)
        adv[:, t] = a * m[:, t]
        next_value = torch.where(m[:, t] > 0, v[:, t], next_value)
        next_adv = torch.where(m[:, t] > 0, a, next_adv)
    return adv, (adv + v) * m


@torch.no_grad()
def group_advantages(
    scores: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO: each score minus its group's mean, over the group's std (``[B]`` -> ``[B]``).

    Rows ``[g * group_size, (g + 1) * group_size)`` are the samples of one prompt. The std is the
    unbiased one (as in DeepSeekMath); a group whose samples all scored the same gets advantage 0.
    ``normalize_std=False`` is Dr. GRPO (mean-centred only).
    """
    b = scores.shape[0]
    if group_size < 1 or b % group_size:
        raise ValueError(f"batch of {b} scores does not split into groups of {group_size}; "
                         "use prompts_per_step * samples_per_prompt rows")
    s = scores.float().view(b // group_size, group_size)
    centred = s - s.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (s.std(dim=1, keepdim=True) + eps)
    return centred.view(b)


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` per-sequence values -> ``[B, T]`` on every valid token (0 on padding)."""
    return seq_values.float()[:, None] * mask.to(torch.float32)


@torch.no_grad()
def ppo_advantages(
    scores: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    whiten: bool = True,
    all_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole PPO advantage step: token rewards, GAE, then (optionally) whitened advantages.

    Returns are computed before whitening (the critic learns the real scale). A data-parallel
    critic passes ``all_sum=trainer.dp.all_sum``: GAE is per sequence, but whitening then uses
    the statistics of the whole batch (every rank's shard), as one rank would.
    """
    rewards = token_rewards(scores, mask, kl=kl, kl_coef=kl_coef)
    adv, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    if whiten:
        adv = masked_whiten(adv, mask, all_sum=all_sum)
    return adv, returns


@torch.no_grad()
def ppo_advantages_ragged(
    scores: torch.Tensor,
    values: Ragged,
    loss_mask: Ragged,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    kl: Ragged | None = None,
    kl_coef: float = 0.0,
    whiten: bool = True,
    all_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[Ragged, Ragged]:
    """:func:`ppo_advantages` of sequences of their own length: ``(advantages, returns)``, Ragged, aligned.

    ``scores [B]``; ``values`` (the critic's, e.g. ``CriticTrainer.values(tokens)``), ``loss_mask``
    and ``kl`` (per-token KL to the reference, or None) aligned with the tokens. The score lands on
    each sequence's last loss-masked token; GAE runs over the loss-masked tokens in order (holes
    closed up); whitening (``all_sum``: over every data-parallel rank) uses the masked tokens only.
    Both results are 0 off the loss mask.
    """
    loss_mask = loss_mask.to_torch()
    v, m = to_grid(flat_aligned("values", values, loss_mask).float(), loss_mask)
    k = to_grid(flat_aligned("kl", kl, loss_mask).float(), loss_mask)[0] if kl is not None else None
    adv, returns = ppo_advantages(scores.to(v.device), v, m, gamma=gamma, lam=lam, kl=k, kl_coef=kl_coef,
                                  whiten=whiten, all_sum=all_sum)
    return from_grid(adv, loss_mask), from_grid(returns, loss_mask)


def broadcast_to_tokens_ragged(seq_values: torch.Tensor, loss_mask: Ragged) -> Ragged:
    """``[B]`` per-sequence values -> a float32 Ragged aligned with ``loss_mask``: the value on every
    loss-masked token of its sequence, 0 elsewhere."""
    m = loss_mask.to_torch()
    if seq_values.shape[0] != m.num_samples:
        raise ValueError(f"{seq_values.shape[0]} per-sequence values for {m.num_samples} sequences")
    return m.like(seq_values.float().to(m.values.device)[m.sample_ids()] * m.values.float())


@torch.no_grad()
def compute_advantages(
    config: AdvantageConfig,
    *,
    scores: torch.Tensor,
    mask: torch.Tensor | Ragged,
    values: torch.Tensor | Ragged | None = None,
    logprobs: torch.Tensor | Ragged | None = None,
    ref_logprobs: torch.Tensor | Ragged | None = None,
    group_size: int | None = None,
    all_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor | Ragged, torch.Tensor | Ragged | None]:
    """Advantages ``[B, T]`` (and GAE returns ``[B, T]``, None for GRPO) as ``config`` says; with a Ragged
    ``mask`` (the loss mask) and Ragged ``values`` / ``logprobs`` / ``ref_logprobs`` aligned with it, Ragged ones.

    What the advantages node and the single-process loop both call. ``gae`` needs the critic's
    ``values``, and with ``kl_coef > 0`` the sampling ``logprobs`` and the reference's
    ``ref_logprobs``; ``grpo`` needs ``group_size`` (samples per prompt, rows grouped by prompt).
    ``all_sum``: on a node with several ranks, their sum (see :func:`ppo_advantages`); GRPO needs
    none, its groups stay whole on one rank.
    """
    ragged = isinstance(mask, Ragged)
    if config.estimator == "grpo":
        if group_size is None:
            raise ValueError("advantage.estimator=grpo needs group_size (samples per prompt)")
        seq = group_advantages(scores, group_size, normalize_std=config.normalize_std)
        return (broadcast_to_tokens_ragged(seq, mask) if ragged else broadcast_to_tokens(seq, mask)), None
    if values is None:
        raise ValueError("advantage.estimator=gae needs the critic's values; add a critic or use estimator=grpo")
    kl = None
    if config.kl_coef:
        if logprobs is None or ref_logprobs is None:
            raise ValueError("advantage.kl_coef > 0 needs logprobs and ref_logprobs (a reference node); "
                             "provide them or set kl_coef=0")
        if ragged:
            kl = mask.to_torch().like(kl_estimate(flat_aligned("logprobs", logprobs, mask),
                                                  flat_aligned("ref_logprobs", ref_logprobs, mask), config.kl_kind))
        else:
            kl = kl_estimate(logprobs, ref_logprobs, config.kl_kind)
    fn = ppo_advantages_ragged if ragged else ppo_advantages
    return fn(scores, values, mask, gamma=config.gamma, lam=config.lam, kl=kl, kl_coef=config.kl_coef,
              whiten=config.whiten, all_sum=all_sum)
