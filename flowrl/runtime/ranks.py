"""Data parallelism inside a node: the ranks of one replica share every batch.

A node with `devices: N` (or a mesh) runs N processes, one torch.distributed group. Rank 0 (the
leader) owns the node's inputs and every input policy (fence, order, joins, version gate); for
each batch it decides to run, it splits the batch into N shards, sends shard r to rank r, runs
shard 0 itself while the others run theirs (so a collective inside `process` — a DDP/FSDP
backward, an all-reduce of a loss count — has every rank in it), gathers the outputs and emits
them concatenated in rank order. Followers see every ticket the leader runs, drops included (as
a marker, without a call), so their watermark and checkpoints follow the leader's exactly.

    shards = split_groups(batch, 2)          # a GRPO group (samples_per_prompt rows) stays whole
    merged = merge_outputs([out0, out1])     # rank order; drops count as empty

Shards travel over flowrl's own channels (ipc between the ranks of one host): no pickle, credit
flow, the same codec as every edge.
"""

from __future__ import annotations

import time

from typing import TYPE_CHECKING

from flowrl.node import REPLACE_MARK, Drop, is_replace
from flowrl.runtime.contract import NodeContractError

if TYPE_CHECKING:
    from flowrl.runtime.inputs import Item

SHARD = "__rank_shard__"  # the pseudo input port on which a follower rank gets its shards
FENCED = "older epoch"  # a follower's answer to a shard of the epoch it left (its leader has yet to hear)


def split_groups(batch, parts: int) -> list:
    """`parts` contiguous shards of near-equal size that never cut a prompt group in two
    (`meta["samples_per_prompt"]` rows each; 1 when absent)."""
    n = batch.num_samples
    g = int(batch.meta.get("samples_per_prompt", 1) or 1)
    if g < 1 or n % g:
        g = 1
    groups = n // g
    base, extra = divmod(groups, parts)
    out, start = [], 0
    for r in range(parts):
        stop = start + (base + (1 if r < extra else 0)) * g
        out.append(batch.select(slice(start, stop)))
        start = stop
    return out


def merge_outputs(outputs: list):
    """The ranks' outputs for one ticket as one: batches concatenated in rank order; a rank that
    dropped (or returned nothing) contributes no samples; all dropped -> a Drop."""
    from flowrl.transport import Batch

    kept = [o for o in outputs if not isinstance(o, Drop) and o is not None and o.num_samples]
    held = [o for o in outputs if isinstance(o, Drop) and o.replace]
    if held and (kept or len(held) < len(outputs)):
        raise NodeContractError(
            f"{len(held)} of {len(outputs)} ranks returned Drop(replace=True) (holding their shard for a later "
            "ticket) and the others did not: a node that holds work across tickets must decide the same on every "
            "rank. Decide from data every rank sees (all-reduce the decision), or run it with devices: 1")
    if not kept:
        drops = [o for o in outputs if isinstance(o, Drop)]
        return drops[0] if drops else Drop("every rank returned an empty batch")
    return Batch.concat(kept) if len(kept) > 1 else kept[0]


def shard_address(sockdir: str, node: str, replica: int, rank: int) -> str:
    return f"ipc://{sockdir}/{node}.{replica}.rank{rank}"


class RankMember:
    """The worker's data-parallel half (mixed into `Worker`): the leader's fan-out and gather, a
    follower's shard loop."""

    async def run_ranks(self, item: Item, method: str):
        """Leader: shard r to rank r, shard 0 here, gather the results in rank order."""
        from flowrl.runtime.contract import outputs_of
        from flowrl.runtime.ranks import merge_outputs, split_groups

        shards = split_groups(item.batch, self.spec.world_size)
        for r, tx in self.rank_tx.items():
            await tx.send(self.stamp(shards[r], item).replace(meta={**shards[r].meta, "_port": item.port}))
        self.recorder.count("rank_samples", shards[0].num_samples, rank="0", per_node=True)
        mine = await self.node.process(shards[0], item.port)
        outputs = [None if self.is_sink else outputs_of(mine, node=self.spec.node, method=method,
                                                        ports=self.cls.outputs)[self.cls.outputs[0]]]
        for r in range(1, self.spec.world_size):
            outputs.append(await self.gather(item, r))
        if self.is_sink:
            return None
        if any(isinstance(o, Drop) and o.reason == FENCED for o in outputs):  # a rank is in a newer
            return {self.cls.outputs[0]: Drop(FENCED)}  # recovery epoch: this ticket is replayed there
        merged = merge_outputs(outputs)
        return {self.cls.outputs[0]: merged}

    async def gather(self, item: Item, rank: int):
        """The result of `rank` for `item`. Replies of other ranks for the same item are kept for
        their turn (they may come in any order); results of older work are dropped."""
        replies = self.rank_replies
        key = (item.batch_id, item.attempt)
        for k in [k for k in replies if k[:2] != key]:
            del replies[k]
        out = replies.pop((*key, rank), None)
        while out is None:
            got = await self.rank_rx.recv()
            await self.rank_rx.ack(got)
            if (got.batch_id, got.attempt) != key:
                continue
            if got.meta.get("_rank") == rank:
                out = got
            else:
                replies[(*key, got.meta.get("_rank"))] = got
        if out.drop is not None:
            return Drop(out.drop.removeprefix(REPLACE_MARK), replace=is_replace(out.drop))
        return out.replace(meta={k: v for k, v in out.meta.items() if k != "_rank"})

    async def tell_followers(self, item: Item) -> None:
        from flowrl.transport import Batch

        marker = Batch(batch_id=item.batch_id, attempt=item.attempt, index=item.index, epoch=item.epoch,
                       drop=item.drop or "dropped")
        for tx in self.rank_tx.values():
            await tx.send(marker)

    async def on_shard(self, shard, rx) -> None:
        """Follower: run the leader's shard (or follow its drop), send the result back."""
        from flowrl.runtime.contract import outputs_of
        from flowrl.transport import Batch

        await rx.ack(shard)
        route = dict(batch_id=shard.batch_id, attempt=shard.attempt, index=shard.index, epoch=shard.epoch)
        if shard.epoch < self.fence.epoch:  # the leader has yet to hear of the recovery: it waits for an
            if shard.drop is None:          # answer (and drops the ticket, which the new epoch replays)
                await self.rank_tx[0].send(Batch(meta={"_rank": self.spec.rank}, drop=FENCED, **route))
            return
        result = None
        if shard.drop is None:
            port = shard.meta.get("_port") or self.cls.inputs[0]
            batch = shard.replace(meta={k: v for k, v in shard.meta.items() if k != "_port"})
            self.recorder.count("rank_samples", batch.num_samples, rank=str(self.spec.rank), per_node=True)
            self.busy = (shard.batch_id, time.monotonic())
            try:
                await self.faults.on_batch(self.step)
                self.step += 1
                out = await self.node.process(batch, port)
            except BaseException:
                self.failed_on = shard.batch_id
                raise
            finally:
                self.busy = None
            if not self.is_sink:
                result = outputs_of(out, node=self.spec.node, method="process", ports=self.cls.outputs)[self.cls.outputs[0]]
            if isinstance(result, Drop):
                reply = Batch(meta={"_rank": self.spec.rank}, drop=result.marker, **route)
            elif result is None:
                reply = Batch(meta={"_rank": self.spec.rank}, **route)
            else:
                reply = result.replace(meta={**result.meta, "_rank": self.spec.rank}, **route)
            await self.rank_tx[0].send(reply)
        if self.cls.publishes_weights:  # the leader's version, kept here too; its snapshot gathers from us
            self.version += 1
            self.nctx.policy_version = self.version
            self.publish_snapshot()
        if self.ordered is not None:  # follow the leader's watermark: checkpoints at the same ticket
            self.ordered.watermark = shard.index + 1
            if self.is_checkpoint_step(self.ordered.watermark):
                await self.save_checkpoint(self.ordered.watermark)

