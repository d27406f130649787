"""Reference: a frozen copy of the initial policy; its log-probs anchor the KL term.

Log-probs are taken at the temperature the batch was sampled at (`meta.temperature`, set on the
rollout), so they compare with the rollout's and the actor's.
"""

from pydantic import Field

import flowrl
from flowrl.nodes.common import ModelConfig, model_on, sampling_temperature


class Reference(flowrl.Node):
    role = "reference"
    requires = {"tokens": "int64", "response_mask": "bool"}

    class Config(ModelConfig):
        temperature: float | None = Field(None, gt=0)
        """Deprecated: read from the batch. If set, it must equal the rollout's temperature."""

    async def setup(self):
        self.model = model_on(self.ctx, self.config.model)

    async def process(self, batch, port):
        import torch

        from flowrl.models import token_logprobs

        temperature = sampling_temperature(batch, self.config.temperature, f"node `{self.ctx.name}`")
        tokens, mask = batch.tensors["tokens"], batch.tensors["response_mask"]
        p_len = tokens.shape[1] - mask.shape[1]
        with torch.no_grad():
            ref = token_logprobs(self.model, tokens.to(self.ctx.device), p_len, temperature=temperature)
        return batch.replace(tensors={**batch.tensors, "ref_logprobs": ref.float().cpu()})
