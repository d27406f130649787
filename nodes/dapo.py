"""DAPO dynamic-sampling filter: drop prompt groups with zero reward variance.

    rollout -> rewards -> dapo -> reference -> advantages -> actor
    dapo: {kind: dapo_filter}

Reads `scores [B*G]` and meta `samples_per_prompt` (G); samples of one prompt are contiguous.
Passes on only the groups whose samples scored differently (every tensor is `select`ed, so the
batch shrinks to K*G rows) and records `dapo_groups_kept`, `dapo_groups_dropped` (sums) and
`dapo_kept_ratio` (mean). A batch with no group left is dropped whole (`process` returns None; the
runtime records the ticket as dropped). The meta key `dapo_need` says how many groups the batch
lacks: what a source would be asked to replace once the runtime can ask for more prompts.
"""

from pydantic import Field

import flowrl


class DapoFilter(flowrl.Node):
    class Config(flowrl.NodeConfig):
        min_std: float = Field(0.0, ge=0)
        """Drop a group whose reward std is at most this (0: only groups of identical rewards)."""

    async def process(self, batch, port):
        from flowrl.rl.dynamic_sampling import filter_groups

        g = int(batch.meta.get("samples_per_prompt", 1))
        f = filter_groups(batch.tensors["scores"], g, self.config.min_std)
        rec = self.ctx.recorder
        rec.count("dapo_groups_kept", f.kept)
        rec.count("dapo_groups_dropped", f.dropped)
        rec.mean("dapo_kept_ratio", f.kept / max(1, f.kept + f.dropped), weight=f.kept + f.dropped)
        if f.kept == 0:
            return None
        if f.dropped == 0:
            return batch
        out = batch.select(f.keep_samples)
        return out.replace(meta={**out.meta, "dapo_need": f.dropped})
