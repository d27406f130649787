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

Every rank makes the same collectives in the same order, because one place decides them: the
leader. For each ticket it decides a `GroupStep` (run the shard; then publish a new weight
version, save a checkpoint) and, for a rollback, one that restores the state; the step travels to
the followers with their shard, in the order the leader takes them. A follower answers each step
at once: `accept` (it is in the step's recovery epoch) or a drop (it already left that epoch). Then
the leader tells every rank that accepted its verdict: `go` when all accepted, else `abort` (no
rank does the step; the new epoch replays the ticket). A rank that accepted does a `go` step even
if it entered a newer epoch meanwhile. So no rank waits in a collective for a rank that will not
come, with any number of ranks.

Shards travel over flowrl's own channels (ipc between the ranks of one host): no pickle, credit
flow, the same codec as every edge.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowrl.node import REPLACE_MARK, Drop, is_replace
from flowrl.runtime.worker.contract import NodeContractError, outputs_of

if TYPE_CHECKING:
    from flowrl.runtime.worker.faults import FaultInjector
    from flowrl.runtime.worker.inputs import Fence, Item
    from flowrl.runtime.worker.outputs import Outputs
    from flowrl.runtime.worker.runner import NodeRunner
    from flowrl.runtime.worker.shape import Shape

log = logging.getLogger("flowrl.worker")

SHARD = "__rank_shard__"  # the pseudo input port on which a follower rank gets its shards
FENCED = "older epoch"  # a follower's answer to a shard of the epoch it left (its leader has yet to hear)


def split_groups(batch, parts: int) -> list:
    """`parts` contiguous shards that never cut a prompt group in two (`meta["samples_per_prompt"]`
    rows each; 1 when absent) and, when the batch has ragged tensors, hold near-equal token counts:
    data-parallel ranks balance tokens, not sequences."""
    return batch.split(parts, by_tokens=True)


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


@dataclass(frozen=True)
class GroupStep:
    """What every rank of a node does for one ticket or one rollback, in this order, after running
    its shard (if the step has one): restore the state of the recovery epoch, publish a new weight
    version, save a checkpoint at a watermark, take part in weight-sync epoch `sync` (a subscriber:
    every rank is a member of the sync group). Decided once, by the leader (`after_ticket`, a
    rollback, a `Sync` order), and followed by every rank (`GroupSteps.follow`, steps.py)."""

    restore: bool = False
    publish: bool = False
    checkpoint: int | None = None
    sync: int | None = None

    def meta(self) -> list:
        return [self.restore, self.publish, self.checkpoint, self.sync]

    @classmethod
    def of(cls, meta: list) -> "GroupStep":
        restore, publish, checkpoint, sync = (list(meta) + [None])[:4]
        return cls(bool(restore), bool(publish), None if checkpoint is None else int(checkpoint),
                   None if sync is None else int(sync))


SKIPPED = GroupStep()  # a ticket no rank ran (a follower was in a newer recovery epoch)


@dataclass(frozen=True)
class FollowUp:
    """What a follower does after a step it ran at its leader's `go`: follow `step` in recovery epoch
    `epoch`, and, when `watermark` is set, take the leader's in-order watermark first (so its
    checkpoints fall at the same ticket). Without `keep`, the step's checkpoint state is made (it
    may be a collective the leader is in) and dropped: no file, no report."""

    step: GroupStep
    epoch: int
    watermark: int | None = None
    keep: bool = True  # False: the step's checkpoint is made and dropped (this rank left its epoch)


class RankGroup:
    """This rank's part of its node's data-parallel group: the leader's fan-out and gather, a
    follower's answers and shards. Its channels come from the worker (worker.py builds them)."""

    def __init__(self, rank: int, world_size: int, rx, *, runner: NodeRunner, faults: FaultInjector, recorder,
                 shape: Shape, outputs: Outputs, fence: Fence, node: str):
        self.rank, self.world_size = rank, world_size
        self._rx = rx  # shards (follower) or replies (leader)
        self._tx: dict[int, object] = {}  # rank -> Sender: the leader's to each follower, a follower's to rank 0
        self._replies: dict[tuple, object] = {}  # the leader's follower replies not yet gathered
        self._accepted = None  # a follower's (shard, step) accepted, waiting for the leader's verdict
        self._markers = 0  # steps the leader sent its followers that belong to no ticket
        self._runner = runner
        self._faults = faults
        self._recorder = recorder
        self._shape = shape
        self._outputs = outputs  # stamps the leader's shards
        self._fence = fence
        self._node = node

    def add_peer(self, rank: int, tx) -> None:
        self._tx[rank] = tx

    @property
    def connected(self) -> bool:
        """Whether this rank can reach its peers yet (the controller's `Wire` order connects them)."""
        return bool(self._tx)

    def senders(self) -> list:
        """This rank's channels to its peers (its own from them is the worker's)."""
        return list(self._tx.values())

    def waiting(self) -> str | None:
        """A follower's step accepted and waiting for the leader's verdict (for dumps)."""
        return None if self._accepted is None else f"{self._accepted[0].batch_id} {self._accepted[1]}"

    async def lead(self, item: Item | None, step: GroupStep, *, epoch: int, shards: list | None = None,
                   marker: str = "rollback") -> bool:
        """Leader: hand every follower its part of one step (its shard of `item`, or a marker: a
        dropped ticket, a rollback) and wait until each answered. True: every follower accepted and
        will do the step; False: one had left `epoch` (no rank does the step). Delivery is proven by
        the answers, not assumed from a queued send: only then may any rank enter a collective."""
        from flowrl.transport import Batch

        route = dict(batch_id=item.batch_id, attempt=item.attempt, index=item.index, epoch=epoch) if item is not None \
            else dict(batch_id=f"{marker}-{epoch}-{self._markers}", attempt=0, index=-1, epoch=epoch)
        self._markers += item is None
        key = (route["batch_id"], route["attempt"])
        for k in [k for k in self._replies if k[:2] != key]:
            del self._replies[k]  # answers to work the leader gave up on (an older attempt)
        for r, tx in self._tx.items():
            if shards is not None:
                part = self._outputs.stamp(shards[r], item)
                part = part.replace(meta={**shards[r].meta, "_port": item.port, "_step": step.meta()})
            else:
                part = Batch(meta={"_step": step.meta()}, drop=(item.drop or "dropped") if item else marker, **route)
            await self._faults.hold()
            await tx.send(part)
        answers = [await self.rank_reply(*key, r, "accept") for r in self._tx]
        go = all(a.drop is None for a in answers)
        for (r, tx), a in zip(self._tx.items(), answers):  # the verdict, to every rank that accepted
            if a.drop is None:
                await tx.send(Batch(meta={"_verdict": "go" if go else "abort"}, **route))
        return go

    async def run_ranks(self, item: Item, step: GroupStep, method: str):
        """Leader: shard r to rank r, shard 0 here, gather the results in rank order. Returns
        SKIPPED when a follower is in a newer recovery epoch (nobody ran the ticket)."""
        shards = split_groups(item.batch, self.world_size)
        if not await self.lead(item, step, epoch=item.epoch, shards=shards):
            return SKIPPED
        self._recorder.count("rank_samples", shards[0].num_samples, rank="0", per_node=True)
        mine = await self._runner.call(item.batch_id, self._runner.node.process, shards[0], item.port)
        outputs = [None if self._shape.sink else outputs_of(mine, node=self._node, method=method,
                                                            ports=self._shape.outputs)[self._shape.outputs[0]]]
        for r in range(1, self.world_size):
            outputs.append(await self.gather(item, r))
        if self._shape.sink:
            return None
        return {self._shape.outputs[0]: merge_outputs(outputs)}

    async def gather(self, item: Item, rank: int):
        """The result of `rank` for `item`."""
        out = await self.rank_reply(item.batch_id, item.attempt, rank, "result")
        if out.drop is not None:
            return Drop(out.drop.removeprefix(REPLACE_MARK), replace=is_replace(out.drop))
        return out.replace(meta={k: v for k, v in out.meta.items() if k not in ("_rank", "_reply")})

    async def rank_reply(self, batch_id: str, attempt: int, rank: int, kind: str):
        """The answer (`accept`) or result (`result`) of `rank` for one step. Replies come in any
        order (of ranks and kinds): the others are kept for their turn."""
        key = (batch_id, attempt, rank, kind)
        got = self._replies.pop(key, None)
        while got is None:
            msg = await self._rx.recv()
            await self._rx.ack(msg)
            k = (msg.batch_id, msg.attempt, msg.meta.get("_rank"), msg.meta.get("_reply", "result"))
            if k == key:
                got = msg
            elif k[:2] == key[:2]:
                self._replies[k] = msg
        return got

    async def on_shard(self, shard, rx) -> FollowUp | None:
        """Follower: answer the leader's step at once (accept, or a drop when this rank already left
        the step's recovery epoch); run an accepted step's shard when the leader's verdict says go, and
        return what this rank then follows (the caller does it: `GroupSteps`, steps.py)."""
        from flowrl.transport import Batch

        await rx.ack(shard)
        verdict = shard.meta.get("_verdict")
        if verdict is not None:
            pending, self._accepted = self._accepted, None
            if pending is None or (pending[0].batch_id, pending[0].attempt) != (shard.batch_id, shard.attempt):
                log.warning("verdict %s for %s, which this rank has not accepted; ignored", verdict, shard.batch_id)
            elif verdict == "go":  # every rank does it now, even one that entered a newer epoch meanwhile
                return await self.do_step(*pending)
            return None
        if shard.epoch < self._fence.epoch:  # the leader has yet to hear of the recovery: nobody does this
            await self._faults.hold()  # step (the new epoch replays the ticket)
            await self._tx[0].send(Batch(meta={"_rank": self.rank, "_reply": "accept"}, drop=FENCED,
                                         batch_id=shard.batch_id, attempt=shard.attempt, index=shard.index,
                                         epoch=shard.epoch))
            return None
        self._accepted = (shard, GroupStep.of(shard.meta.get("_step") or [False, False, None]))
        await self._faults.hold()
        await self._tx[0].send(Batch(meta={"_rank": self.rank, "_reply": "accept"}, batch_id=shard.batch_id,
                                     attempt=shard.attempt, index=shard.index, epoch=shard.epoch))
        return None

    async def do_step(self, shard, step: GroupStep) -> FollowUp:
        """Follower: run the step's shard (if it has one), send the result back; returns the step to follow.
        A rank that entered a newer recovery epoch since it accepted still makes the step's
        collectives (its leader is in them: the shard's, a publish's gathers, and a checkpoint's
        `state_dict`, which a sharded trainer's may gather in), but keeps none of its bookkeeping: no
        watermark, no checkpoint file (the newer epoch's restore comes next, at the leader's word)."""
        from flowrl.transport import Batch

        route = dict(batch_id=shard.batch_id, attempt=shard.attempt, index=shard.index, epoch=shard.epoch)
        if shard.drop is None:
            port = shard.meta.get("_port") or self._shape.inputs[0]
            batch = shard.replace(meta={k: v for k, v in shard.meta.items() if k not in ("_port", "_step")})
            self._recorder.count("rank_samples", batch.num_samples, rank=str(self.rank), per_node=True)
            out = await self._runner.call(shard.batch_id, self._runner.node.process, batch, port)
            result = None if self._shape.sink else \
                outputs_of(out, node=self._node, method="process", ports=self._shape.outputs)[self._shape.outputs[0]]
            meta = {"_rank": self.rank, "_reply": "result"}
            if isinstance(result, Drop):
                answer = Batch(meta=meta, drop=result.marker, **route)
            elif result is None:
                answer = Batch(meta=meta, **route)
            else:
                answer = result.replace(meta={**result.meta, **meta}, **route)
            await self._faults.hold()
            await self._tx[0].send(answer)
        if shard.epoch != self._fence.epoch:
            return FollowUp(step, shard.epoch, keep=False)
        # the leader's watermark: checkpoints at the same ticket
        return FollowUp(step, shard.epoch, watermark=shard.index + 1 if shard.index >= 0 else None)
