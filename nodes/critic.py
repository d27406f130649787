"""Critic: values for a batch, GAE advantages and returns, and a value update on those returns.

Stateful: it trains. The runtime hands it each ticket once, in order, and rolls it back together
with the actor when either restarts (a replayed ticket gets the output it got the first time), so
each batch changes its state exactly once and actor and critic stay at the same step.
"""

from pydantic import Field

import flowrl
from flowrl.nodes.common import ModelConfig, OffloadsTrainer, Sequences, check_fits, model_on
from flowrl.rl import AdvantageConfig, CriticConfig


class Critic(OffloadsTrainer, flowrl.Node):
    role = "critic"
    requires = {"tokens": "int64", "logprobs": "float32", "scores": "float32"}
    stateful = True

    class Config(ModelConfig):
        train: CriticConfig = Field(default_factory=CriticConfig)
        """Optimizer and value-loss settings."""
        advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
        """GAE settings (gamma, lam, KL penalty in the reward, whitening)."""

    async def setup(self):
        from flowrl.rl import CriticTrainer

        model = model_on(self.ctx, self.config.model, value_head=True, trainable=True)
        self.trainer = CriticTrainer(model, self.config.train, seed=self.ctx.seed)

    async def process(self, batch, port):
        from flowrl.rl import kl_estimate, ppo_advantages_ragged

        t = batch.tensors
        where = f"node `{self.ctx.name}`"
        seqs = Sequences.of(batch, where)
        check_fits(seqs.tokens, self.trainer.model, where, batch.meta.get("tokenizer"), self.config.model)
        adv_cfg = self.config.advantage
        old_values = self.trainer.values(seqs.tokens)
        kl = None
        if adv_cfg.kl_coef and "ref_logprobs" in t:
            logprobs, ref = seqs.per_token(batch, "logprobs", where), seqs.per_token(batch, "ref_logprobs", where)
            kl = logprobs.like(kl_estimate(logprobs.values, ref.values, adv_cfg.kl_kind) * seqs.loss_mask.values)
        adv, returns = ppo_advantages_ragged(t["scores"], old_values, seqs.loss_mask, gamma=adv_cfg.gamma,
                                             lam=adv_cfg.lam, kl=kl, kl_coef=adv_cfg.kl_coef, whiten=adv_cfg.whiten,
                                             all_sum=self.trainer.dp.all_sum)
        metrics = self.trainer.train_step(tokens=seqs.tokens, loss_mask=seqs.loss_mask, returns=returns,
                                          old_values=old_values)
        for k, v in metrics.items():
            self.ctx.recorder.mean(f"critic_{k}", float(v))
        values = old_values.like(old_values.values * seqs.loss_mask.values)
        return batch.replace(tensors={**t, "values": seqs.emit(values), "advantages": seqs.emit(adv),
                                      "returns": seqs.emit(returns)})

    def state_dict(self):
        return self.trainer.state_dict()

    def load_state_dict(self, state):
        self.trainer.load_state_dict(state)
