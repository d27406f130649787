"""A rollout for text datasets: stops and pads with the tokenizer the batch names (not the digit vocabulary).

The built-in rollout ends responses at the digit tasks' EOS id (13) and pads with theirs (14).
SmolLM2's end of turn is `<|im_end|>` (id 2), so this node takes both ids from the tokenizer
named in the batch meta (`tokenizer`, written by the `dataset` source). Otherwise it is the
built-in rollout: same outputs, same seeded sampling, same weight subscription.
"""

import time

import flowrl
from flowrl.nodes.rollout import Rollout


class TextRollout(Rollout):
    async def process(self, batch, port):
        import torch

        from flowrl.data import tokenizer_for
        from flowrl.models import generate

        tok = tokenizer_for(batch.meta["tokenizer"])
        g = self.config.samples_per_prompt
        prompts = batch.tensors["prompts"].repeat_interleave(g, 0).to(self.ctx.device)
        targets = batch.tensors["targets"].repeat_interleave(g, 0)
        index = max(batch.index, 0)
        gen_rng = torch.Generator(device=self.ctx.device).manual_seed(self.ctx.seed * 1_000_003 + index)
        t0 = time.perf_counter()
        out = generate(self.model, prompts, max_new_tokens=self.config.max_new_tokens or batch.meta["max_new_tokens"],
                       temperature=self.config.temperature, top_p=self.config.top_p, eos_id=tok.eos_id,
                       pad_id=tok.pad_id, generator=gen_rng)
        self.ctx.recorder.observe("rollout_latency_s", time.perf_counter() - t0)
        return flowrl.Batch(
            tensors={"tokens": out.tokens.cpu(), "response_mask": out.response_mask.cpu(),
                     "logprobs": out.logprobs.float().cpu(), "targets": targets},
            meta={**batch.meta, "samples_per_prompt": g, "temperature": self.config.temperature},
            policy_version=self.ctx.policy_version,
        )
