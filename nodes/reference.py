"""Reference: a frozen copy of the initial policy; its log-probs anchor the KL term."""

from pydantic import Field

import flowrl
from flowrl.nodes.common import ModelConfig, model_on


class Reference(flowrl.Node):
    role = "reference"
    requires = {"tokens": "int64", "response_mask": "bool"}

    class Config(ModelConfig):
        temperature: float = Field(1.0, gt=0)
        """Must match the rollout's sampling temperature."""

    async def setup(self):
        self.model = model_on(self.ctx, self.config.model)

    async def process(self, batch, port):
        import torch

        from flowrl.models import token_logprobs

        tokens, mask = batch.tensors["tokens"], batch.tensors["response_mask"]
        p_len = tokens.shape[1] - mask.shape[1]
        with torch.no_grad():
            ref = token_logprobs(self.model, tokens.to(self.ctx.device), p_len, temperature=self.config.temperature)
        return batch.replace(tensors={**batch.tensors, "ref_logprobs": ref.float().cpu()})
