"""Critic: values for a batch, GAE advantages and returns, and a value update on those returns.

Stateful: it trains. The runtime hands it each ticket once, in order, and rolls it back together
with the actor when either restarts (a replayed ticket gets the output it got the first time), so
each batch changes its state exactly once and actor and critic stay at the same step.
"""

from pydantic import Field

import flowrl
from flowrl.nodes.common import ModelConfig, model_on
from flowrl.rl import AdvantageConfig, CriticConfig


class Critic(flowrl.Node):
    role = "critic"
    requires = {"tokens": "int64", "response_mask": "bool", "logprobs": "float32", "scores": "float32"}
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
        from flowrl.rl import kl_estimate, ppo_advantages

        t = batch.tensors
        tokens, mask = t["tokens"], t["response_mask"]
        p_len = tokens.shape[1] - mask.shape[1]
        adv_cfg = self.config.advantage
        old_values = self.trainer.values(tokens, p_len).cpu()
        kl = None
        if adv_cfg.kl_coef and "ref_logprobs" in t:
            kl = kl_estimate(t["logprobs"], t["ref_logprobs"], adv_cfg.kl_kind)
        adv, returns = ppo_advantages(t["scores"], old_values, mask, gamma=adv_cfg.gamma, lam=adv_cfg.lam,
                                      kl=kl, kl_coef=adv_cfg.kl_coef, whiten=adv_cfg.whiten,
                                      all_sum=self.trainer.dp.all_sum)
        metrics = self.trainer.train_step(tokens=tokens, prompt_len=p_len, response_mask=mask,
                                          returns=returns, old_values=old_values)
        for k, v in metrics.items():
            self.ctx.recorder.mean(f"critic_{k}", float(v))
        return batch.replace(tensors={**t, "values": old_values, "advantages": adv, "returns": returns})

    def state_dict(self):
        return self.trainer.state_dict()

    def load_state_dict(self, state):
        self.trainer.load_state_dict(state)
