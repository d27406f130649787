"""Group-normalised advantages (GRPO): each score minus its prompt group's mean (over its std)."""

import flowrl


class GroupAdvantages(flowrl.Node):
    requires = {"scores": "float32", "response_mask": "bool"}

    class Config(flowrl.NodeConfig):
        normalize_std: bool = True
        """Divide by the group's std (False: Dr. GRPO, mean-centred only)."""

    async def process(self, batch, port):
        from flowrl.rl import broadcast_to_tokens, group_advantages

        g = int(batch.meta.get("samples_per_prompt", 1))
        scores, mask = batch.tensors["scores"], batch.tensors["response_mask"]
        adv = broadcast_to_tokens(group_advantages(scores, g, normalize_std=self.config.normalize_std), mask)
        return batch.replace(tensors={**batch.tensors, "advantages": adv})
