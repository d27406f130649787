"""Reference: a frozen copy of the initial policy; its log-probs anchor the KL term.

Log-probs are taken at the temperature the batch was sampled at (`meta.temperature`, set on the
rollout), so they compare with the rollout's and the actor's.
"""

from pydantic import Field

import flowrl
from flowrl.nodes.common import ModelConfig, Sequences, check_fits, model_on, sampling_temperature


class Reference(flowrl.Node):
    role = "reference"
    requires = {"tokens": "int64"}

    class Config(ModelConfig):
        temperature: float | None = Field(None, gt=0)
        """Deprecated: read from the batch. If set, it must equal the rollout's temperature."""
        max_tokens_per_microbatch: int | None = Field(8192, ge=1)
        """Sequences are packed into forward passes of at most this many tokens (None: one pass)."""

    async def setup(self):
        self.model = model_on(self.ctx, self.config.model)

    async def process(self, batch, port):
        from flowrl.models.packing import packed_logprobs

        where = f"node `{self.ctx.name}`"
        temperature = sampling_temperature(batch, self.config.temperature, where)
        seqs = Sequences.of(batch, where)
        check_fits(seqs.tokens, self.model, where, batch.meta.get("tokenizer"), self.config.model)
        ref = packed_logprobs(self.model, seqs.tokens, temperature=temperature,
                              max_tokens=self.config.max_tokens_per_microbatch, where=where)
        return batch.replace(tensors={**batch.tensors, "ref_logprobs": seqs.emit(ref)})
