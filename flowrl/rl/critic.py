"""The value update of PPO, one batch at a time (what the ``critic`` node wraps).

    >>> critic = CriticTrainer(value_model, CriticConfig(lr=1e-3), seed=0)
    >>> v = critic.values(tokens, P)                                          # [B, T], no grad
    >>> adv, returns = ppo_advantages(scores, v, mask)                        # doctest: +SKIP
    >>> critic.train_step(tokens=tokens, prompt_len=P, response_mask=mask,
    ...                   returns=returns, old_values=v)                     # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.models.sampling import values as model_values
from flowrl.rl.config import CriticConfig
from flowrl.rl.losses import value_loss
from flowrl.rl.trainer import Trainer, mean_metrics


class CriticTrainer(Trainer):
    """Owns the value model and its optimizer; ``train_step`` regresses values on returns."""

    config: CriticConfig

    def __init__(self, model: torch.nn.Module, config: CriticConfig | None = None, *, seed: int = 0,
                 group: Any = None) -> None:
        super().__init__(model, config or CriticConfig(), seed=seed, group=group)

    @torch.no_grad()
    def values(self, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Values ``[B, T]`` of the current critic for a batch (the ``old_values`` of its update)."""
        self.model.eval()
        return model_values(self.model, tokens.to(self.device), prompt_len)

    def train_step(
        self,
        *,
        tokens: torch.Tensor,
        prompt_len: int,
        response_mask: torch.Tensor,
        returns: torch.Tensor,
        old_values: torch.Tensor,
    ) -> dict[str, float]:
        """One update; returns value_loss, value_clipfrac, grad_norm, explained_variance, ..."""
        cfg = self.config
        dev = self.device
        tokens, mask = tokens.to(dev), response_mask.to(dev).bool()
        returns, old_values = returns.to(dev).float(), old_values.to(dev).float()
        self.model.train()
        rows = []  # per mini-batch: name -> (this rank's value, its weight), reduced over ranks below
        for idx in self._minibatches(tokens.shape[0]):
            m = mask[idx]
            v = model_values(self.model, tokens[idx], prompt_len)
            loss, clipfrac = value_loss(
                v, old_values[idx], returns[idx], m, clip_range=cfg.clip_range_value, agg=cfg.loss_agg
            )
            denom = self._denominator(m)
            row = {"value_loss": (float(loss.detach()), denom), "value_clipfrac": (float(clipfrac), float(m.sum()))}
            if self.dp.enabled:  # this rank's part of the mini-batch's global mean (see _global_share)
                scale, _ = self._global_share(denom)
                loss = loss * scale if len(idx) else v.sum() * 0.0  # no rows: still join the collectives
            row["grad_norm"] = (self._optimizer_step(loss), 1.0)
            row["lr"] = (self.optimizer.param_groups[0]["lr"], 1.0)
            rows.append(row)
        self.updates += 1
        out = mean_metrics(self.dp.weighted_means(rows))
        # batch statistics over every rank's tokens: sums, reduced once
        resid = returns - old_values
        m = mask.double()
        sums = self.dp.all_sum(torch.stack([
            m.sum(), (resid * m).sum(), (resid**2 * m).sum(), (returns * m).sum(), (returns**2 * m).sum(),
            (old_values * m).sum(),
        ]).double().cpu())
        n, r1, r2, g1, g2, v1 = sums.tolist()
        var = lambda s1, s2: max(s2 - s1 * s1 / max(n, 1.0), 0.0) / max(n - 1, 1.0)  # noqa: E731 - unbiased
        out["explained_variance"] = float(1.0 - var(r1, r2) / max(var(g1, g2), 1e-8))
        out["values_mean"] = v1 / max(n, 1.0)
        out["returns_mean"] = g1 / max(n, 1.0)
        return out
