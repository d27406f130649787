"""Typed configs of the RL algorithms (no torch import: the graph loader uses them).

Unknown keys are rejected. The field defaults are plain, safe ones (one mini-batch, no KL, no
entropy bonus); the values measured to learn the built-in tasks fastest on a CPU are the presets
in ``flowrl/rl/single_process.py`` (measured with ``benchmarks/single_process.py``). For a large
Hugging Face model use the usual smaller learning rates (1e-6 .. 1e-5).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


LOSS_AGG_ALIASES = {
    "dapo": "token_mean",
    "bnpo": "token_mean",
    "grpo": "seq_mean_token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
}
"""TRL's ``GRPOConfig.loss_type`` names (those that are a loss aggregation) -> flowrl's ``loss_agg``.

TRL's ``dapo`` divides by the active tokens of the whole generation batch and ``bnpo`` by those of
the local micro-batch; a flowrl mini-batch is one optimizer step whose token count is global over
its micro-batches and ranks, so both are ``token_mean`` here (equal to TRL's ``dapo`` always, and
to ``bnpo`` with one micro-batch). ``dr_grpo`` needs ``loss_agg_norm_len`` (TRL: ``max_completion_length``).
"""


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OptimConfig(_Config):
    """AdamW, linear warm-up then constant (or linear decay), gradient-norm clipping; shared by actor and critic."""

    lr: float = Field(1e-3, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW moment decay rates."""
    eps: float = Field(1e-8, gt=0)
    """AdamW denominator epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up from 0 to ``lr``."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """None: the learning rate stays at ``lr`` after the warm-up. N: it then falls linearly to 0 at optimizer
    step N -- the 0-based step ``k >= warmup_steps`` uses ``lr * (N - k) / (N - warmup_steps)``, which is
    Hugging Face's (and so TRL's) default ``linear`` scheduler with N = ``max_steps`` x optimizer steps per
    batch (``mini_batches * epochs``); steps past N use 0."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this (None: no clipping; the norm is still reported)."""
    epochs: int = Field(1, ge=1)
    """Passes over each batch (PPO epochs)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch: the batch is shuffled and split into this many parts."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = \
        "token_mean"
    """How per-token losses become one number; see ``flowrl.rl.losses`` (DAPO's token mean, GRPO's sequence
    mean, Dr. GRPO's constant-normalised sum) and docs/packing.md. TRL's ``loss_type`` names are accepted as
    aliases (``LOSS_AGG_ALIASES``): ``dapo`` and ``bnpo`` = ``token_mean`` (one optimizer step per mini-batch,
    no gradient accumulation across steps), ``grpo`` = ``seq_mean_token_mean``, ``dr_grpo`` =
    ``seq_mean_token_sum_norm``."""
    loss_agg_norm_len: int | None = Field(None, ge=1)
    """``seq_mean_token_sum_norm`` (Dr. GRPO): the constant each sequence's token sum is divided by (usually the
    response length cap, ``max_new_tokens``); required by that mode, unused by the others."""
    max_tokens_per_microbatch: int | None = Field(4096, ge=1)
    """Token budget of one forward/backward pass: each mini-batch's sequences are packed (no padding) into
    micro-batches of at most this many tokens, gradients accumulate over them, one optimizer step per
    mini-batch. Bounds activation memory; the update does not depend on it (to float rounding). A sequence
    longer than this is an error. None: one micro-batch per mini-batch."""

    @model_validator(mode="before")
    @classmethod
    def _loss_agg_aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("loss_agg") in LOSS_AGG_ALIASES:
            data = {**data, "loss_agg": LOSS_AGG_ALIASES[data["loss_agg"]]}
        return data

    @model_validator(mode="after")
    def _norm_len_for_sum_norm(self) -> "OptimConfig":
        if self.loss_agg == "seq_mean_token_sum_norm" and self.loss_agg_norm_len is None:
            raise ValueError("loss_agg=seq_mean_token_sum_norm divides each sequence's token sum by a constant: "
                             "set loss_agg_norm_len (e.g. the rollout's max_new_tokens)")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.warmup_steps:
            raise ValueError(f"lr_decay_steps={self.lr_decay_steps} must exceed warmup_steps={self.warmup_steps}: the "
                             "decay runs from the end of the warm-up to step lr_decay_steps")
        return self


class LoraConfig(_Config):
    """Low-rank adapters (LoRA, with peft: ``pip install 'flowrl[lora]'``) on a Hugging Face actor.

    The base stays frozen; only the adapters train, sit in the optimizer and the checkpoints, and
    travel to the rollouts (docs/lora.md)."""

    r: int = Field(16, ge=1)
    """Rank of each adapter."""
    alpha: float = Field(32.0, gt=0)
    """Scaling numerator: an adapter adds ``(alpha / r) * B @ A`` to its weight."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Linear layers to adapt, by the last part of their name (peft's ``target_modules``)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (none at inference)."""
    reference_from_base: bool = False
    """Compute the KL term's reference log-probs here, with the adapters switched off (the frozen base
    is the initial policy), when a batch has no ``ref_logprobs``: the graph needs no reference node.
    Needs ``kl_loss_coef > 0``."""

    @model_validator(mode="after")
    def _targets(self) -> "LoraConfig":
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty; name the linear layers to adapt, e.g. "
                             "[q_proj, k_proj, v_proj, o_proj]")
        return self


class ActorConfig(OptimConfig):
    """The policy update: PPO clipped objective, optional KL loss and entropy bonus."""

    clip_low: float = Field(0.2, ge=0)
    """Lower clip of the ratio: ``1 - clip_low``."""
    clip_high: float = Field(0.2, ge=0)
    """Upper clip of the ratio: ``1 + clip_high`` (larger than ``clip_low`` = DAPO's clip-higher)."""
    dual_clip: float | None = Field(None, gt=1)
    """Bound the loss of negative-advantage tokens by ``dual_clip * |A|`` (None: off)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    kl_loss_coef: float = Field(0.0, ge=0)
    """Weight of a KL(policy || reference) loss term (GRPO style); needs reference log-probs."""
    kl_loss_kind: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of that KL loss; see ``flowrl.rl.losses.kl_estimate``."""
    temperature: float | None = Field(None, gt=0)
    """Deprecated: the temperature travels with the batch (set it on the rollout). If set, it must
    equal the batch's; the log-probs are recomputed at that temperature."""
    old_logprobs: Literal["auto", "rollout", "recompute"] = "auto"
    """The PPO ratio's denominator. ``rollout``: the log-probs the rollout engine returned.
    ``recompute``: the trainer's own, from one no-grad pass over the batch before the update
    (what verl calls ``old_log_prob``): the ratio then starts at exactly 1, whatever engine
    sampled. ``auto``: ``recompute`` when ``rollout_is`` is on, else ``rollout``."""
    rollout_is: Literal["off", "truncate", "mask"] = "off"
    """Importance-sampling correction of the rollout-vs-trainer mismatch (another engine, or
    ``max_staleness >= 1``): ``truncate`` = TIS, token weight ``min(pi_old / pi_rollout, cap)``;
    ``mask`` = drop tokens whose ratio leaves ``[floor, cap]``. Needs recomputed old log-probs.
    See ``flowrl.rl.losses.rollout_importance_weights``."""
    rollout_is_cap: float = Field(2.0, ge=1)
    """C: the largest importance weight (``truncate``) or ratio kept (``mask``)."""
    rollout_is_floor: float | None = Field(None, ge=0, le=1)
    """``mask``: smallest ratio kept (None: ``1 / rollout_is_cap``)."""
    lora: LoraConfig | None = None
    """None: full fine-tuning. Set: train low-rank adapters on a frozen Hugging Face base, e.g.
    ``lora: {r: 16, alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj]}`` (docs/lora.md)."""

    @model_validator(mode="after")
    def _is_needs_recompute(self) -> "ActorConfig":
        if self.rollout_is != "off" and self.old_logprobs == "rollout":
            raise ValueError(
                f"rollout_is={self.rollout_is} weighs tokens by pi_old / pi_rollout, which needs the trainer's "
                "own old log-probs; set old_logprobs: recompute (or auto)"
            )
        if self.lora is not None and self.lora.reference_from_base and not self.kl_loss_coef:
            raise ValueError("lora.reference_from_base computes reference log-probs for the KL loss, which is off: "
                             "set kl_loss_coef > 0, or remove reference_from_base")
        return self

    @property
    def recompute_old_logprobs(self) -> bool:
        return self.old_logprobs == "recompute" or (self.old_logprobs == "auto" and self.rollout_is != "off")


class CriticConfig(OptimConfig):
    """The value update: clipped squared error against GAE returns."""

    clip_range_value: float | None = Field(None, gt=0)
    """Clip new values to ``old +- clip_range_value`` in the loss (None: plain squared error)."""


class AdvantageConfig(_Config):
    """How scores become per-token advantages."""

    estimator: Literal["gae", "grpo"] = "gae"
    """``gae``: PPO with a critic; ``grpo``: score minus the mean of its prompt's group (no critic)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per token (GAE)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda: 1 = Monte-Carlo returns minus value, 0 = one-step TD."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty in the reward: ``r_t -= kl_coef * KL_t`` vs the reference (needs reference log-probs)."""
    kl_kind: Literal["k1", "k2", "k3"] = "k1"
    """Estimator of that per-token KL."""
    whiten: bool = True
    """Normalise GAE advantages over the batch (mean 0, std 1)."""
    normalize_std: bool = True
    """GRPO: divide by the group's std (False = Dr. GRPO, mean-centred only)."""


class RolloutConfig(_Config):
    """How the policy samples."""

    temperature: float = Field(1.0, ge=0)
    """Softmax temperature; 0 = greedy (no exploration, for evaluation only)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Generation budget; None = what the task needs (answer + EOS)."""
    prompts_per_step: int = Field(16, ge=1)
    """Distinct prompts in one training batch."""
    samples_per_prompt: int = Field(4, ge=1)
    """Completions per prompt (GRPO's group size; > 1 gives PPO several samples per prompt too)."""
