"""The policy update of PPO and GRPO, one batch at a time (what the ``actor`` node wraps).

    >>> actor = ActorTrainer(policy, ActorConfig(lr=1e-3), seed=0)
    >>> metrics = actor.train_step(tokens=gen.tokens, prompt_len=P, response_mask=gen.response_mask,
    ...                            old_logprobs=gen.logprobs, advantages=adv)   # doctest: +SKIP
    >>> metrics["policy_loss"], metrics["clipfrac"], metrics["grad_norm"]        # doctest: +SKIP

PPO and GRPO differ only in their advantages (computed before, see ``flowrl.rl.advantages``) and
in where the KL to the reference goes: PPO usually puts it in the reward, GRPO in the loss
(``kl_loss_coef`` here, which then needs ``ref_logprobs``).
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.models.sampling import entropy_from_logits, logprobs_from_logits
from flowrl.rl.config import ActorConfig
from flowrl.rl.losses import aggregate, kl_estimate, ppo_policy_loss
from flowrl.rl.masked import masked_mean
from flowrl.rl.trainer import Trainer, mean_metrics


class ActorTrainer(Trainer):
    """Owns the policy and its optimizer; ``train_step`` = epochs x mini-batches of clipped PPO."""

    config: ActorConfig

    def __init__(self, model: torch.nn.Module, config: ActorConfig | None = None, *, seed: int = 0,
                 group: Any = None) -> None:
        super().__init__(model, config or ActorConfig(), seed=seed, group=group)

    def train_step(
        self,
        *,
        tokens: torch.Tensor,
        prompt_len: int,
        response_mask: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        ref_logprobs: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One update on a batch; returns metrics averaged over its mini-batch steps.

        ``tokens [B, P+T]``; ``response_mask``, ``old_logprobs`` (the sampling policy's, as
        :func:`flowrl.models.generate` returns them), ``advantages`` and ``ref_logprobs`` are
        ``[B, T]`` (a ``[B]`` advantage per sequence is broadcast over its tokens).
        """
        cfg = self.config
        if cfg.kl_loss_coef and ref_logprobs is None:
            raise ValueError("kl_loss_coef > 0 needs ref_logprobs from the reference node; pass them or set kl_loss_coef=0")
        dev = self.device
        mask = response_mask.to(dev).bool()
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(mask)
        tokens, old_logprobs, advantages = tokens.to(dev), old_logprobs.to(dev), advantages.to(dev).float()
        ref = ref_logprobs.to(dev) if ref_logprobs is not None else None
        self.model.train()
        rows = []  # per mini-batch: name -> (this rank's value, its weight), reduced over ranks below
        for idx in self._minibatches(tokens.shape[0]):
            m = mask[idx]
            logits = self.model(tokens[idx])[:, prompt_len - 1 : -1].float() / cfg.temperature  # [b, T, V]
            logprobs = logprobs_from_logits(logits, tokens[idx, prompt_len:])
            entropy = entropy_from_logits(logits if cfg.entropy_coef else logits.detach())
            pg_loss, stats = ppo_policy_loss(
                logprobs, old_logprobs[idx], advantages[idx], m,
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, agg=cfg.loss_agg,
            )
            ent = aggregate(entropy, m, cfg.loss_agg)
            loss = pg_loss - cfg.entropy_coef * ent
            denom, n_tok = self._denominator(m), float(m.sum())
            row = {"policy_loss": (float(pg_loss.detach()), denom), "entropy": (float(ent.detach()), denom)}
            if ref is not None:
                kl = kl_estimate(logprobs, ref[idx], cfg.kl_loss_kind)
                kl_loss = aggregate(kl, m, cfg.loss_agg)
                if cfg.kl_loss_coef:
                    loss = loss + cfg.kl_loss_coef * kl_loss
                row["kl"] = (float(kl_loss.detach()), denom)
            if self.dp.enabled:  # this rank's part of the mini-batch's global mean (see _global_share)
                scale, _ = self._global_share(denom)
                loss = loss * scale if len(idx) else logits.sum() * 0.0  # no rows: still join the collectives
            row["grad_norm"] = (self._optimizer_step(loss), 1.0)
            row.update({k: (float(v), n_tok) for k, v in stats.items()})
            row["lr"] = (self.optimizer.param_groups[0]["lr"], 1.0)
            rows.append(row)
        self.updates += 1
        summary = {"response_len": (float(mask.float().sum(dim=1).mean()) if len(mask) else 0.0, float(len(mask))),
                   "advantage_mean": (float(masked_mean(advantages, mask)), float(mask.sum()))}
        *rows, summary = self.dp.weighted_means([*rows, summary])
        return {**mean_metrics(rows), **summary}
