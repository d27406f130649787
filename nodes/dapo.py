"""DAPO dynamic sampling: drop prompt groups with zero reward variance, and fill each training
batch back up with the groups of later tickets.

    rollout -> rewards -> dapo -> reference -> advantages -> actor
    dapo: {kind: dapo_filter, config: {max_batches: 10}}

Reads `scores [B*G]` and meta `samples_per_prompt` (G); samples of one prompt are contiguous. A
group whose samples all scored the same has GRPO advantage 0: it costs a training pass and
teaches nothing. The filter keeps the other groups whole, in order, and:

- `fill: true` (the default, DAPO's dynamic sampling): holds the kept groups until it has
  `groups` of them (default: the ticket's own prompt count), then passes on a batch of exactly
  that many. A ticket whose groups are held is dropped with `replace=True`, so the scheduler
  issues one more ticket in its place: the source is asked for replacement prompts and the run
  still makes `schedule.steps` training updates. After `max_batches` tickets without a full batch
  it passes on what it has (counted in `dapo_underfilled`), or drops the ticket for good when it
  has nothing. Held groups are part of the node's checkpointed state (the node is stateful), so a
  crash neither loses nor repeats one. Groups held past the end of the run stay unused
  (`dapo_groups_held` says how many).
- `fill: false`: passes on the smaller batch (only the kept groups); a batch with no group left is
  dropped whole.

Metrics: `dapo_groups_kept`, `dapo_groups_dropped` (sums), `dapo_kept_ratio` (mean),
`dapo_tickets_per_batch` (mean, fill mode), `dapo_underfilled` (count), `dapo_groups_held` (gauge).
Held groups are older than the ticket they train with: the batch's `policy_version` is its oldest
sample's, so the sinks' `staleness` metric shows the true age (at most `max_batches` steps more
than `schedule.max_staleness`: a surplus group waits for the next batch).
"""

from __future__ import annotations

from pydantic import Field

import flowrl


class DapoFilter(flowrl.Node):
    stateful = True

    class Config(flowrl.NodeConfig):
        min_std: float = Field(0.0, ge=0)
        """Drop a group whose reward std is at most this (0: only groups of identical rewards)."""
        fill: bool = True
        """Fill each batch to `groups` groups with the kept groups of later tickets (DAPO); false:
        pass on the smaller batch."""
        groups: int | None = Field(None, ge=1)
        """Groups (prompts) per training batch when filling, at least the ticket's prompt count; None:
        the ticket's own prompt count."""
        max_batches: int = Field(10, ge=1)
        """Tickets one training batch may gather groups from; then it goes on with what it has."""

    async def setup(self):
        self.held: list[flowrl.Batch] = []  # kept groups of earlier tickets, oldest first
        self.waited = 0  # tickets that went into the batch being filled

    async def process(self, batch, port):
        from flowrl.rl.dynamic_sampling import filter_groups

        g = int(batch.meta.get("samples_per_prompt", 1))
        f = filter_groups(batch.tensors["scores"], g, self.config.min_std)
        rec = self.ctx.recorder
        rec.count("dapo_groups_kept", f.kept)
        rec.count("dapo_groups_dropped", f.dropped)
        rec.mean("dapo_kept_ratio", f.kept / max(1, f.kept + f.dropped), weight=f.kept + f.dropped)
        kept = batch if f.dropped == 0 else batch.select(f.keep_samples) if f.kept else None
        if not self.config.fill:
            return kept
        prompts = batch.num_samples // g
        if self.config.groups is not None and self.config.groups < prompts:
            raise ValueError(f"dapo_filter: groups={self.config.groups} is below the ticket's {prompts} prompts; the "
                             "filter passes on one batch per ticket, so the surplus would pile up. Set groups >= "
                             "schedule.batch_size, or leave it unset (the ticket's prompt count)")
        return self.fill(kept, batch, g, target=self.config.groups or prompts)

    def fill(self, kept, batch, g: int, target: int):
        rec = self.ctx.recorder
        if kept is not None:
            self.held.append(kept.to_torch())  # one kind of tensor, whatever the channel delivered
        self.waited += 1
        have = sum(b.num_samples for b in self.held) // g
        if have < target and self.waited < self.config.max_batches:
            rec.gauge("dapo_groups_held", have)
            return flowrl.Drop(f"{have}/{target} groups with reward variance after {self.waited} tickets; "
                               "held for the next batch", replace=True)
        rec.mean("dapo_tickets_per_batch", self.waited)
        self.waited = 0
        if have == 0:
            rec.gauge("dapo_groups_held", 0)
            return flowrl.Drop(f"no group with reward variance in {self.config.max_batches} tickets")
        rec.count("dapo_underfilled", int(have < target))
        taken, need = [], target * g
        while need and self.held:  # oldest groups first; each part keeps its own policy version
            part = self.held[0]
            if part.num_samples <= need:
                taken.append(self.held.pop(0))
            else:
                taken.append(part.select(slice(0, need)))
                self.held[0] = part.select(slice(need, None))
            need -= taken[-1].num_samples
        rec.gauge("dapo_groups_held", sum(b.num_samples for b in self.held) // g)
        out = self.merge(taken, batch)
        return out.replace(meta={**out.meta, "dapo_groups": min(have, target)})

    @staticmethod
    def merge(parts, batch):
        """Groups of several tickets as one batch with this ticket's meta (its sampling facts)."""
        first = parts[0]
        for b in parts[1:]:
            for name, t in b.tensors.items():
                mine = first.tensors.get(name)
                if mine is None or isinstance(mine, flowrl.Ragged) != isinstance(t, flowrl.Ragged) or (
                        not isinstance(t, flowrl.Ragged) and tuple(mine.shape[1:]) != tuple(t.shape[1:])):
                    raise ValueError(
                        f"dapo_filter cannot put groups of {first.batch_id} and {b.batch_id} in one batch: tensor "
                        f"{name!r} is {_layout(mine)} in one and {_layout(t)} in the other. Ragged tensors "
                        "(the rollout's default layout) join whatever their lengths; rectangular ones need one "
                        "width in every ticket (use `rollout: {layout: ragged}`) or set fill: false")
        return flowrl.Batch.concat(parts, meta=batch.meta)

    def state_dict(self):
        # ragged tensors are kept as their values and offsets (torch.save stores plain tensors only)
        return {"waited": self.waited,
                "held": [{"tensors": _plain(b.to_torch().tensors), "meta": dict(b.meta), "batch_id": b.batch_id,
                          "policy_version": b.policy_version} for b in self.held]}

    def load_state_dict(self, state):
        self.waited = int(state["waited"])
        self.held = [flowrl.Batch(tensors=_unplain(h["tensors"]), meta=h["meta"], batch_id=h["batch_id"],
                                  policy_version=int(h["policy_version"])) for h in state["held"]]


def _layout(t) -> str:
    if t is None:
        return "missing"
    if isinstance(t, flowrl.Ragged):
        return "ragged"
    return f"rectangular {list(t.shape)}"


def _plain(tensors: dict) -> dict:
    """Tensors as torch.save's weights_only loader reads them: a ragged one as {values, offsets}."""
    return {k: {"ragged_values": v.values, "ragged_offsets": v.offsets} if isinstance(v, flowrl.Ragged) else v
            for k, v in tensors.items()}


def _unplain(tensors: dict) -> dict:
    return {k: flowrl.Ragged(v["ragged_values"], v["ragged_offsets"]) if isinstance(v, dict) else v
            for k, v in tensors.items()}
