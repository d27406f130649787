"""What follows a ticket (or a rollback) on every rank of a node: the `GroupStep` the leader
decided, done in the same order on every rank.

    steps = GroupSteps(state, syncs, ranks, fence)
    await steps.follow(GroupStep(publish=True, checkpoint=8))      # after a ticket, on this rank
    await steps.take(GroupStep(checkpoint=12), epoch=3, marker="end")  # the leader decides for all

The leader decides each step (docs/data-parallel.md, "Which thread runs what, and who decides each
collective"); followers get it with their shard and do it at its `go` (`ranks.py`).
"""

from __future__ import annotations

from flowrl.runtime.worker.inputs import Fence
from flowrl.runtime.worker.nodestate import NodeState
from flowrl.runtime.worker.ranks import GroupStep, RankGroup
from flowrl.runtime.worker.syncs import WeightSyncs


class GroupSteps:
    """Does group steps on this rank; owns a rollback ordered before the leader could reach its
    followers (done once it can)."""

    def __init__(self, state: NodeState, syncs: WeightSyncs, ranks: RankGroup | None, fence: Fence):
        self._state = state
        self._syncs = syncs
        self._ranks = ranks
        self._fence = fence
        self._deferred: tuple[GroupStep, int] | None = None

    async def follow(self, step: GroupStep, epoch: int | None = None, keep: bool = True) -> None:
        """Do what follows a ticket (or a rollback) on this rank, in the order every rank does it.
        `epoch`: the step's recovery epoch (default: this rank's). Without `keep` (a follower that
        left the step's epoch, `FollowUp`) a checkpoint is made for its collectives and dropped."""
        if step.restore:
            await self._state.restore(self._fence.epoch if epoch is None else epoch)
        if step.publish:
            await self._state.publish()
        if step.checkpoint is not None:
            await (self._state.save(step.checkpoint) if keep else self._state.make_and_drop())
        if step.sync is not None:
            await self._syncs.join(step.sync)

    async def take(self, step: GroupStep, epoch: int, marker: str = "rollback") -> None:
        """The leader's step that belongs to no ticket (a rollback, the run's end): every rank does
        it, or none (a follower already left `epoch`)."""
        if self._ranks is None or await self._ranks.lead(None, step, epoch=epoch, marker=marker):
            await self.follow(step, epoch)

    async def take_rollback(self, step: GroupStep, epoch: int) -> None:
        """A rollback: taken now, or, on a leader not yet wired to its followers, once it is (`wired`)."""
        if self._ranks is not None and not self._ranks.connected:
            self._deferred = (step, epoch)
            return
        await self.take(step, epoch)

    async def wired(self) -> None:
        """The leader reaches its followers now: a rollback ordered before is taken."""
        if self._deferred is not None:
            (step, epoch), self._deferred = self._deferred, None
            await self.take(step, epoch)
