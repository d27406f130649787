"""Rollout: samples responses with the weights of a known policy version.

Subscribes to the actor's weights; the runtime swaps them in between batches and never hands it a
batch whose required version it does not hold yet. Each output batch records the version it was
generated with (`policy_version`), which the actor's staleness bound is checked against.
"""

import time

from pydantic import Field

import flowrl
from flowrl.nodes.common import ModelConfig, model_on


class Rollout(flowrl.Node):
    role = "rollout"
    requires = {"prompts": "int64", "targets": "int64"}
    subscribes_weights = True

    class Config(ModelConfig):
        samples_per_prompt: int = Field(4, ge=1)
        """Completions per prompt (GRPO's group size)."""
        temperature: float = Field(1.0, ge=0)
        top_p: float = Field(1.0, gt=0, le=1)
        max_new_tokens: int | None = Field(None, ge=1)
        """Generation budget; default: what the task needs."""

    async def setup(self):
        self.model = model_on(self.ctx, self.config.model)

    def weights(self):
        return self.model.state_dict()  # live tensors: new versions are received in place

    async def process(self, batch, port):
        import torch

        from flowrl.models import generate
        from flowrl.tasks import EOS, PAD

        g = self.config.samples_per_prompt
        prompts = batch.tensors["prompts"].repeat_interleave(g, 0).to(self.ctx.device)
        targets = batch.tensors["targets"].repeat_interleave(g, 0)
        index = max(batch.index, 0)
        gen_rng = torch.Generator(device=self.ctx.device).manual_seed(self.ctx.seed * 1_000_003 + index)
        t0 = time.perf_counter()
        out = generate(self.model, prompts, max_new_tokens=self.config.max_new_tokens or batch.meta["max_new_tokens"],
                       temperature=self.config.temperature, top_p=self.config.top_p, eos_id=EOS, pad_id=PAD,
                       generator=gen_rng)
        self.ctx.recorder.observe("rollout_latency_s", time.perf_counter() - t0)
        return flowrl.Batch(
            tensors={"tokens": out.tokens.cpu(), "response_mask": out.response_mask.cpu(),
                     "logprobs": out.logprobs.float().cpu(), "targets": targets},
            meta={**batch.meta, "samples_per_prompt": g, "temperature": self.config.temperature},
            policy_version=self.ctx.policy_version,
        )
