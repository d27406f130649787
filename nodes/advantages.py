"""Group-normalised advantages (GRPO): each score minus its prompt group's mean (over its std),
given to every trained token of the sequence (aligned with `tokens`; a [R, T] grid for a batch in
the rectangular layout)."""

import flowrl
from flowrl.nodes.common import Sequences


class GroupAdvantages(flowrl.Node):
    requires = {"scores": "float32"}

    class Config(flowrl.NodeConfig):
        normalize_std: bool = True
        """Divide by the group's std (False: Dr. GRPO, mean-centred only)."""

    async def process(self, batch, port):
        from flowrl.rl import group_advantages

        g = int(batch.meta.get("samples_per_prompt", 1))
        seqs = Sequences.of(batch, f"node `{self.ctx.name}`")
        per_seq = group_advantages(batch.tensors["scores"], g, normalize_std=self.config.normalize_std)
        mask = seqs.loss_mask.values
        adv = seqs.tokens.like(per_seq.float()[seqs.tokens.sample_ids()] * mask)
        return batch.replace(tensors={**batch.tensors, "advantages": seqs.emit(adv)})
