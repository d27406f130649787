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
from flowrl.rl.losses import aggregate, kl_estimate, logprob_mismatch, ppo_policy_loss, rollout_importance_weights
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
        temperature: float | None = None,
    ) -> dict[str, float]:
        """One update on a batch; returns metrics averaged over its mini-batch steps.

        ``tokens [B, P+T]``; ``response_mask``, ``old_logprobs`` (the sampling policy's, as
        :func:`flowrl.models.generate` or a rollout engine returns them), ``advantages`` and
        ``ref_logprobs`` are ``[B, T]`` (a ``[B]`` advantage per sequence is broadcast over its
        tokens). ``temperature``: what the batch was sampled at (0 = greedy: unscaled log-probs).

        The metrics include the train/rollout mismatch (``mismatch_logprob_abs_mean``,
        ``mismatch_logprob_abs_max``, ``mismatch_kl``: trainer vs rollout log-probs of the same
        tokens, before any update), taken over the whole batch when old log-probs are recomputed,
        else over the first mini-batch (the only one scored before an optimizer step).
        """
        cfg = self.config
        if cfg.kl_loss_coef and ref_logprobs is None:
            raise ValueError("kl_loss_coef > 0 needs ref_logprobs from the reference node; pass them or set kl_loss_coef=0")
        temperature = self._temperature(temperature)
        dev = self.device
        mask = response_mask.to(dev).bool()
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(mask)
        tokens, old_logprobs, advantages = tokens.to(dev), old_logprobs.to(dev), advantages.to(dev).float()
        ref = ref_logprobs.to(dev) if ref_logprobs is not None else None
        self.model.train()
        rollout_logprobs, loss_mask, is_weights, extra = old_logprobs, mask, None, {}
        extra_weight = float(mask.sum())  # tokens the mismatch statistics were taken over
        if cfg.recompute_old_logprobs:
            old_logprobs = self._logprobs_no_grad(tokens, prompt_len, temperature)
            extra.update(logprob_mismatch(old_logprobs, rollout_logprobs, mask))
            is_weights, loss_mask, is_stats = rollout_importance_weights(
                old_logprobs, rollout_logprobs, mask, mode=cfg.rollout_is, cap=cfg.rollout_is_cap, floor=cfg.rollout_is_floor)
            extra.update(is_stats)
        rows = []  # per mini-batch: name -> (this rank's value, its weight), reduced over ranks below
        for idx in self._minibatches(tokens.shape[0]):
            m = loss_mask[idx]
            logits = self.model(tokens[idx])[:, prompt_len - 1 : -1].float() / temperature  # [b, T, V]
            logprobs = logprobs_from_logits(logits, tokens[idx, prompt_len:])
            if not extra:  # first mini-batch, no update yet: the model still is the rollout's policy
                extra.update(logprob_mismatch(logprobs.detach(), rollout_logprobs[idx], mask[idx]))
                extra_weight = float(mask[idx].sum())
            entropy = entropy_from_logits(logits if cfg.entropy_coef else logits.detach())
            pg_loss, stats = ppo_policy_loss(
                logprobs, old_logprobs[idx], advantages[idx], m,
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, agg=cfg.loss_agg,
                is_weights=None if is_weights is None else is_weights[idx],
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
                   "advantage_mean": (float(masked_mean(advantages, mask)), float(mask.sum())),
                   **{k: (float(v), extra_weight) for k, v in extra.items() if not k.endswith("_max")}}
        *rows, summary = self.dp.weighted_means([*rows, summary])
        maxima = {k: self.dp.all_max(float(v)) for k, v in sorted(extra.items()) if k.endswith("_max")}
        return {**mean_metrics(rows), **summary, **maxima}

    def _temperature(self, carried: float | None) -> float:
        """The divisor of the logits: the batch's temperature (0 = greedy = 1), checked against the config."""
        configured = self.config.temperature
        if carried is not None and configured is not None and float(carried) != float(configured):
            raise ValueError(
                f"actor train.temperature={configured} but the batch was sampled at temperature={carried}; "
                "remove train.temperature (the rollout's temperature travels with the batch)"
            )
        t = carried if carried is not None else (configured if configured is not None else 1.0)
        return float(t) if t > 0 else 1.0

    @torch.no_grad()
    def _logprobs_no_grad(self, tokens: torch.Tensor, prompt_len: int, temperature: float) -> torch.Tensor:
        """The current policy's log-probs ``[B, T]`` of the batch, in mini-batch-sized chunks."""
        out = []
        for chunk in tokens.tensor_split(self.config.mini_batches):
            logits = self.model(chunk)[:, prompt_len - 1 : -1].float() / temperature
            out.append(logprobs_from_logits(logits, chunk[:, prompt_len:]))
        return torch.cat(out)
