"""The policy update of PPO and GRPO, one batch at a time (what the ``actor`` node wraps).

    >>> actor = ActorTrainer(policy, ActorConfig(lr=1e-3, max_tokens_per_microbatch=4096), seed=0)
    >>> metrics = actor.train_step(tokens=gen.tokens, loss_mask=gen.loss_mask,     # Ragged, aligned
    ...                            old_logprobs=gen.logprobs, advantages=adv)      # doctest: +SKIP
    >>> metrics["policy_loss"], metrics["clipfrac"], metrics["grad_norm"]        # doctest: +SKIP

PPO and GRPO differ only in their advantages (computed before, see ``flowrl.rl.advantages``) and
in where the KL to the reference goes: PPO usually puts it in the reward, GRPO in the loss
(``kl_loss_coef`` here, which then needs ``ref_logprobs``).

With ``config.lora`` the adapters are injected into the model here (:func:`flowrl.models.lora.apply_lora`,
before any sharding): only they train, sit in the optimizer and the checkpoint (with a reference to
the base, checked on restore), and ``lora.reference_from_base`` computes the KL's reference log-probs
with the adapters switched off when a batch brings none.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.models.packing import aligned_logprobs, forward_packed, packed_logprobs
from flowrl.rl.config import ActorConfig
from flowrl.rl.losses import kl_estimate, logprob_mismatch, loss_weights, ppo_token_loss, rollout_importance_weights
from flowrl.rl.masked import masked_mean
from flowrl.rl.tokens import TokenBatch, flat_aligned, rect_to_ragged, seq_values_to_tokens
from flowrl.rl.trainer import Trainer, mean_metrics
from flowrl.transport.ragged import Ragged


class ActorTrainer(Trainer):
    """Owns the policy and its optimizer; ``train_step`` = epochs x mini-batches of clipped PPO."""

    config: ActorConfig

    def __init__(self, model: torch.nn.Module, config: ActorConfig | None = None, *, seed: int = 0,
                 group: Any = None) -> None:
        config = config or ActorConfig()
        self.base: dict[str, Any] | None = None
        """LoRA: which base the adapters belong to (``flowrl.models.lora.base_reference``)."""
        if config.lora is not None:
            from flowrl.models.lora import apply_lora, base_reference

            apply_lora(model, config.lora, seed=seed)
            self.base = base_reference(model)
        super().__init__(model, config, seed=seed, group=group, trainable_only=config.lora is not None)

    def state_dict(self) -> dict[str, Any]:
        """The trainer's state; with LoRA the adapters only, plus ``lora`` (its config) and ``base``."""
        state = super().state_dict()
        if self.config.lora is not None:
            state.update(lora=self.config.lora.model_dump(mode="json"), base=dict(self.base or {}))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        lora = self.config.lora
        if (lora is None) != ("lora" not in state):
            have = "adapters only (LoRA)" if "lora" in state else "a full model"
            raise ValueError(f"the checkpoint holds {have} but this actor {'does not use' if lora is None else 'uses'}"
                             " train.lora; resume with the train.lora setting the run was saved with")
        if lora is not None:
            from flowrl.models.lora import check_same_base

            check_same_base(state.get("base", {}), self.base or {})
        super().load_state_dict(state)

    @torch.no_grad()
    def base_logprobs(self, tokens: Ragged, temperature: float) -> Ragged:
        """Aligned log-probs of ``tokens`` under the frozen base (adapters off): the reference policy."""
        from flowrl.models.lora import adapters_disabled

        with adapters_disabled(self.model):
            return packed_logprobs(self.model, tokens, temperature=temperature,
                                   max_tokens=self.config.max_tokens_per_microbatch, where="actor",
                                   passes=self._passes)

    def train_step(
        self,
        *,
        tokens: Ragged | torch.Tensor,
        old_logprobs: Ragged | torch.Tensor,
        advantages: Ragged | torch.Tensor,
        loss_mask: Ragged | None = None,
        ref_logprobs: Ragged | torch.Tensor | None = None,
        temperature: float | None = None,
        prompt_len: int | None = None,
        response_mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One update on a batch; returns metrics averaged over its mini-batch steps.

        Ragged (sequences of their own length): ``tokens`` int64; ``loss_mask`` (bool),
        ``old_logprobs`` (the sampling policy's, as the rollout returned them) and ``ref_logprobs``
        aligned with the tokens (entry j for token j; see ``flowrl.models.generation``);
        ``advantages`` aligned too, or ``[B]``, one per sequence. ``temperature``: what the batch was
        sampled at (0 = greedy: unscaled log-probs).

        Legacy (rectangular): ``tokens [B, P+T]``, ``prompt_len``, ``response_mask``,
        ``old_logprobs``, ``ref_logprobs`` ``[B, T]``, ``advantages`` ``[B, T]`` or ``[B]``: turned into
        the ragged batch (loss mask on the masked response tokens, the padding after the last one
        dropped) and trained on the same way.

        The metrics include the train/rollout mismatch (``mismatch_logprob_abs_mean``,
        ``mismatch_logprob_abs_max``, ``mismatch_kl``: trainer vs rollout log-probs of the same
        tokens, before any update), taken over the whole batch when old log-probs are recomputed,
        else over the first mini-batch (the only one scored before an optimizer step).
        """
        if not isinstance(tokens, Ragged):
            if prompt_len is None or response_mask is None:
                raise TypeError("a [B, L] tokens tensor needs prompt_len and response_mask (or pass Ragged tokens "
                                "with an aligned loss_mask)")
            tokens, loss_mask, f = rect_to_ragged(tokens, prompt_len, response_mask, old_logprobs=old_logprobs,
                                                  advantages=advantages, ref_logprobs=ref_logprobs)
            old_logprobs, advantages, ref_logprobs = f["old_logprobs"], f["advantages"], f["ref_logprobs"]
        elif loss_mask is None:
            raise TypeError("Ragged tokens need a loss_mask aligned with them (True on the tokens to train on)")
        cfg = self.config
        if ref_logprobs is None and cfg.kl_loss_coef and cfg.lora is not None and cfg.lora.reference_from_base:
            ref_logprobs = self.base_logprobs(tokens, self._temperature(temperature))
        if cfg.kl_loss_coef and ref_logprobs is None:
            raise ValueError("kl_loss_coef > 0 needs ref_logprobs from the reference node; pass them or set "
                             "kl_loss_coef=0")
        adv = flat_aligned("advantages", advantages, tokens) if isinstance(advantages, Ragged) else \
            seq_values_to_tokens(torch.as_tensor(advantages), tokens)
        fields = {"mask": flat_aligned("loss_mask", loss_mask, tokens).bool(),
                  "rollout": flat_aligned("old_logprobs", old_logprobs, tokens).float(), "adv": adv.float(),
                  "ref": None if ref_logprobs is None else flat_aligned("ref_logprobs", ref_logprobs, tokens).float()}
        batch = TokenBatch(tokens, self.device, fields)
        self._check_budget(batch.lengths, "actor")
        return self._update(batch, tokens, self._temperature(temperature))

    def _update(self, batch: TokenBatch, tokens: Ragged, temperature: float) -> dict[str, float]:
        cfg = self.config
        self.model.train()
        mask, rollout = batch["mask"], batch["rollout"]
        extra: dict[str, torch.Tensor] = {}
        extra_weight = float(mask.sum())  # tokens the mismatch statistics were taken over
        batch.fields.update(old=rollout, keep=mask)
        if cfg.recompute_old_logprobs:
            old = packed_logprobs(self.model, tokens, temperature=temperature, max_tokens=cfg.max_tokens_per_microbatch,
                                  where="actor", passes=self._passes).values.to(self.device)
            extra.update(logprob_mismatch(old, rollout, mask))
            is_weights, keep, is_stats = rollout_importance_weights(
                old, rollout, mask, mode=cfg.rollout_is, cap=cfg.rollout_is_cap, floor=cfg.rollout_is_floor)
            extra.update(is_stats)
            batch.fields.update(old=old, keep=keep, is_weights=is_weights)
        seq_valid = batch.seq_sums(batch["keep"])  # T_i: each sequence's tokens in the loss
        rows = []  # per mini-batch: name -> (this rank's value, its weight), reduced over ranks below
        for idx in self._minibatches(batch.num_sequences):
            scored = [] if not extra else None  # first mini-batch, no update yet: the model still is the rollout's
            row = self._minibatch(batch, idx, seq_valid, temperature, scored)
            if scored is not None:
                lp, ro, m = (torch.cat([s[i] for s in scored]) if scored else torch.zeros(0, device=self.device)
                             for i in range(3))
                extra.update(logprob_mismatch(lp, ro, m.bool()))
                extra_weight = float(m.sum())
            rows.append(row)
        self.updates += 1
        seq_tokens = batch.seq_sums(mask)
        summary = {"response_len": (float(seq_tokens.mean()) if len(seq_tokens) else 0.0, float(len(seq_tokens))),
                   "advantage_mean": (float(masked_mean(batch["adv"], mask)), float(mask.sum())),
                   **{k: (float(v), extra_weight) for k, v in extra.items() if not k.endswith("_max")}}
        *rows, summary = self.dp.weighted_means([*rows, summary])
        maxima = {k: self.dp.all_max(float(v)) for k, v in sorted(extra.items()) if k.endswith("_max")}
        return {**mean_metrics(rows), **summary, **maxima}

    def _minibatch(self, batch: TokenBatch, idx: torch.Tensor, seq_valid: torch.Tensor, temperature: float,
                   scored: list | None) -> dict[str, tuple[float, float]]:
        """Forward and backward over the micro-batches of one mini-batch, then one optimizer step."""
        cfg = self.config
        plan, passes, n_tok, n_seq = self._plan(batch, idx, seq_valid, "actor")
        has_ref = "ref" in batch.fields
        sums = torch.zeros(7, dtype=torch.float64)  # policy loss, entropy, kl, clipped, approx kl, ratio, tokens
        self.optimizer.zero_grad(set_to_none=True)
        for mb in self._micro(batch, plan, passes):
            f = mb.fields
            logits = forward_packed(self.model, mb.tokens, mb.cu_seqlens)
            lp, ent = aligned_logprobs(logits, mb.tokens, mb.cu_seqlens, temperature, entropy=True,
                                       entropy_grad=bool(cfg.entropy_coef))
            w = loss_weights(f["keep"], seq_valid[mb.seq].float(), cfg.loss_agg, tokens=n_tok, sequences=n_seq,
                             norm_len=cfg.loss_agg_norm_len)
            pg, clipped, ratio, log_ratio = ppo_token_loss(
                lp, f["old"], f["adv"], clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                is_weights=f.get("is_weights"))
            pg_loss, ent_loss = (w * pg).sum(), (w * ent).sum()
            loss = pg_loss - cfg.entropy_coef * ent_loss
            kl_loss = pg_loss.new_zeros(())
            if has_ref:
                kl_loss = (w * kl_estimate(lp, f["ref"], cfg.kl_loss_kind)).sum()
                if cfg.kl_loss_coef:
                    loss = loss + cfg.kl_loss_coef * kl_loss
            self._backward(loss)
            m = f["keep"].float()
            sums += torch.stack([pg_loss.detach(), ent_loss.detach(), kl_loss.detach(), (clipped.float() * m).sum(),
                                 ((ratio - 1.0 - log_ratio) * m).sum(), (ratio * m).sum(), m.sum()]).double().cpu()
            if scored is not None:
                scored.append((lp.detach(), f["rollout"], f["mask"].float()))
        grad_norm = self._optimizer_step()
        pg_sum, ent_sum, kl_sum, clip_sum, akl_sum, ratio_sum, n = sums.tolist()
        world = float(self.dp.world_size)  # a rank's part of each sum, times the ranks: their mean is the sum
        row = {"policy_loss": (pg_sum * world, 1.0), "entropy": (ent_sum * world, 1.0)}
        if has_ref:
            row["kl"] = (kl_sum * world, 1.0)
        row["grad_norm"] = (grad_norm, 1.0)
        row.update({k: (v / n if n else 0.0, n) for k, v in
                    (("clipfrac", clip_sum), ("approx_kl", akl_sum), ("ratio_mean", ratio_sum))})
        row["lr"] = (self.optimizer.param_groups[0]["lr"], 1.0)
        return row

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
