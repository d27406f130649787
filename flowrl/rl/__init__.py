"""RL algorithms: pure advantage and loss functions, and the actor / critic trainers built on them.

    >>> from flowrl.rl import ActorTrainer, ActorConfig, gae, group_advantages, ppo_policy_loss

Layout: ``masked`` (reductions over valid tokens), ``tokens`` (ragged per-token data: legacy grids
in, micro-batches out, the loss-masked grid GAE runs on), ``advantages`` (GAE, GRPO groups, KL-penalised
token rewards), ``losses`` (clipped policy and value losses, KL estimators), ``trainer`` / ``actor``
/ ``critic`` (model-aware update steps with checkpointable state; data parallel over a node's ranks
with ``parallel``, published from shards with ``publish``), ``single_process`` (the whole
algorithm as one plain loop). The configs import without torch; the rest loads it on first use.
"""

from __future__ import annotations

from typing import Any

from flowrl.rl.config import ActorConfig, AdvantageConfig, CriticConfig, LoraConfig, OptimConfig, RolloutConfig

__all__ = [
    "ActorConfig", "AdvantageConfig", "CriticConfig", "LoraConfig", "OptimConfig", "RolloutConfig",
    "ActorTrainer", "CriticTrainer", "FullState", "full_state_items",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten",
    "gae", "group_advantages", "token_rewards", "ppo_advantages", "broadcast_to_tokens", "compute_advantages",
    "ppo_advantages_ragged", "broadcast_to_tokens_ragged", "to_grid", "from_grid",
    "aggregate", "loss_weights", "kl_estimate", "ppo_policy_loss", "value_loss", "entropy_bonus",
]

_LAZY = {
    "ActorTrainer": "flowrl.rl.actor",
    "CriticTrainer": "flowrl.rl.critic",
    "FullState": "flowrl.rl.publish",
    "full_state_items": "flowrl.rl.parallel",
    **{n: "flowrl.rl.masked" for n in ("masked_mean", "masked_sum", "masked_var", "masked_whiten")},
    **{n: "flowrl.rl.advantages" for n in ("gae", "group_advantages", "token_rewards", "ppo_advantages",
                                           "broadcast_to_tokens", "compute_advantages", "ppo_advantages_ragged",
                                           "broadcast_to_tokens_ragged")},
    **{n: "flowrl.rl.tokens" for n in ("to_grid", "from_grid")},
    **{n: "flowrl.rl.losses" for n in ("aggregate", "loss_weights", "kl_estimate", "ppo_policy_loss", "value_loss",
                                       "entropy_bonus")},
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flowrl.rl' has no attribute {name!r}")
