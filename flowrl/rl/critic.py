"""The value update of PPO, one batch at a time (what the ``critic`` node wraps).

    >>> critic = CriticTrainer(value_model, CriticConfig(lr=1e-3), seed=0)
    >>> v = critic.values(tokens, P)                                          # [B, T], no grad
    >>> adv, returns = ppo_advantages(scores, v, mask)                        # doctest: +SKIP
    >>> critic.train_step(tokens=tokens, prompt_len=P, response_mask=mask,
    ...                   returns=returns, old_values=v)                     # doctest: +SKIP
"""

from __future__ import annotations

import torch

from flowrl.models.sampling import values as model_values
from flowrl.rl.config import CriticConfig
from flowrl.rl.losses import value_loss
from flowrl.rl.masked import masked_mean, masked_var
from flowrl.rl.trainer import Trainer, mean_metrics


class CriticTrainer(Trainer):
    """Owns the value model and its optimizer; ``train_step`` regresses values on returns."""

    config: CriticConfig

    def __init__(self, model: torch.nn.Module, config: CriticConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(model, config or CriticConfig(), seed=seed)

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
        rows = []
        for idx in self._minibatches(tokens.shape[0]):
            v = model_values(self.model, tokens[idx], prompt_len)
            loss, clipfrac = value_loss(
                v, old_values[idx], returns[idx], mask[idx], clip_range=cfg.clip_range_value, agg=cfg.loss_agg
            )
            rows.append({
                "value_loss": float(loss.detach()),
                "value_clipfrac": float(clipfrac),
                "grad_norm": self._optimizer_step(loss),
                "lr": self.optimizer.param_groups[0]["lr"],
            })
        self.updates += 1
        out = mean_metrics(rows)
        resid = masked_var(returns - old_values, mask) / masked_var(returns, mask).clamp(min=1e-8)
        out["explained_variance"] = float(1.0 - resid)
        out["values_mean"] = float(masked_mean(old_values, mask))
        out["returns_mean"] = float(masked_mean(returns, mask))
        return out
