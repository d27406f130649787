"""The value update of PPO, one batch at a time (what the ``critic`` node wraps).

    >>> critic = CriticTrainer(value_model, CriticConfig(lr=1e-3), seed=0)
    >>> v = critic.values(tokens)                                             # Ragged, aligned, no grad
    >>> adv, returns = ppo_advantages_ragged(scores, v, loss_mask)           # doctest: +SKIP
    >>> critic.train_step(tokens=tokens, loss_mask=loss_mask, returns=returns, old_values=v)  # doctest: +SKIP

The legacy rectangular forms (``values(tokens [B, P+T], P) -> [B, T]``, ``train_step(tokens=...,
prompt_len=P, response_mask=..., returns=[B, T], old_values=[B, T])``) run the same packed code.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.models.packing import forward_packed, packed_values, shift_to_tokens
from flowrl.rl.config import CriticConfig
from flowrl.rl.losses import loss_weights, value_token_loss
from flowrl.rl.tokens import TokenBatch, flat_aligned, rect_to_ragged, to_rect
from flowrl.rl.trainer import Trainer, mean_metrics
from flowrl.transport.ragged import Ragged


class CriticTrainer(Trainer):
    """Owns the value model and its optimizer; ``train_step`` regresses values on returns."""

    config: CriticConfig

    def __init__(self, model: torch.nn.Module, config: CriticConfig | None = None, *, seed: int = 0,
                 group: Any = None) -> None:
        super().__init__(model, config or CriticConfig(), seed=seed, group=group)

    @torch.no_grad()
    def values(self, tokens: Ragged | torch.Tensor, prompt_len: int | None = None) -> Ragged | torch.Tensor:
        """The current critic's values for a batch (the ``old_values`` of its update), packed, no grad.

        Ragged tokens: a float32 Ragged on the CPU, aligned with them (entry j = V(state before token j)).
        Legacy ``tokens [B, P+T]`` and ``prompt_len``: ``[B, T]`` on the trainer's device.
        """
        legacy = not isinstance(tokens, Ragged)
        if legacy:
            if prompt_len is None or not 0 < prompt_len < tokens.shape[1]:
                raise ValueError(f"tokens of shape {tuple(tokens.shape)} need a prompt_len in 1..{tokens.shape[1] - 1}")
            rect = tokens
            tokens = Ragged.from_padded(tokens.detach().cpu())
        self._check_budget(tokens.lengths.cpu().numpy(), "critic")
        self.model.eval()
        v = packed_values(self.model, tokens, max_tokens=self.config.max_tokens_per_microbatch, where="critic",
                          passes=self._passes)
        return to_rect(v, prompt_len, rect.shape[1] - prompt_len).to(self.device) if legacy else v

    def train_step(
        self,
        *,
        tokens: Ragged | torch.Tensor,
        returns: Ragged | torch.Tensor,
        old_values: Ragged | torch.Tensor,
        loss_mask: Ragged | None = None,
        prompt_len: int | None = None,
        response_mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One update; returns value_loss, value_clipfrac, grad_norm, explained_variance, ...

        Ragged: ``loss_mask``, ``returns`` and ``old_values`` aligned with ``tokens``. Legacy:
        ``tokens [B, P+T]``, ``prompt_len``, ``response_mask``, ``returns`` and ``old_values`` ``[B, T]``.
        """
        if not isinstance(tokens, Ragged):
            if prompt_len is None or response_mask is None:
                raise TypeError("a [B, L] tokens tensor needs prompt_len and response_mask (or pass Ragged tokens "
                                "with an aligned loss_mask)")
            tokens, loss_mask, f = rect_to_ragged(tokens, prompt_len, response_mask, returns=returns,
                                                  old_values=old_values)
            returns, old_values = f["returns"], f["old_values"]
        elif loss_mask is None:
            raise TypeError("Ragged tokens need a loss_mask aligned with them (True on the tokens to train on)")
        batch = TokenBatch(tokens, self.device, {
            "mask": flat_aligned("loss_mask", loss_mask, tokens).bool(),
            "returns": flat_aligned("returns", returns, tokens).float(),
            "old": flat_aligned("old_values", old_values, tokens).float()})
        self._check_budget(batch.lengths, "critic")
        self.model.train()
        seq_valid = batch.seq_sums(batch["mask"])
        rows = [self._minibatch(batch, idx, seq_valid) for idx in self._minibatches(batch.num_sequences)]
        self.updates += 1
        out = mean_metrics(self.dp.weighted_means(rows))
        # batch statistics over every rank's tokens: sums, reduced once
        mask, returns, old_values = batch["mask"], batch["returns"], batch["old"]
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

    def _minibatch(self, batch: TokenBatch, idx: torch.Tensor, seq_valid: torch.Tensor) -> dict[str, tuple]:
        """Forward and backward over the micro-batches of one mini-batch, then one optimizer step."""
        cfg = self.config
        plan, passes, n_tok, n_seq = self._plan(batch, idx, seq_valid, "critic")
        sums = torch.zeros(3, dtype=torch.float64)  # value loss, clipped tokens, tokens
        self.optimizer.zero_grad(set_to_none=True)
        for mb in self._micro(batch, plan, passes):
            f = mb.fields
            v = shift_to_tokens(forward_packed(self.model, mb.tokens, mb.cu_seqlens).float(), mb.cu_seqlens)
            w = loss_weights(f["mask"], seq_valid[mb.seq].float(), cfg.loss_agg, tokens=n_tok, sequences=n_seq,
                             norm_len=cfg.loss_agg_norm_len)
            per_token, clipped = value_token_loss(v, f["old"], f["returns"], clip_range=cfg.clip_range_value)
            loss = (w * per_token).sum()
            self._backward(loss)
            m = f["mask"].float()
            sums += torch.stack([loss.detach(), (clipped.float() * m).sum(), m.sum()]).double().cpu()
        grad_norm = self._optimizer_step()
        loss_sum, clip_sum, n = sums.tolist()
        return {"value_loss": (loss_sum * self.dp.world_size, 1.0), "value_clipfrac": (clip_sum / n if n else 0.0, n),
                "grad_norm": (grad_norm, 1.0), "lr": (self.optimizer.param_groups[0]["lr"], 1.0)}
