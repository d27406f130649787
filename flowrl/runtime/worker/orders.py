"""The controller's orders that change a node's progress: a ticket, a rollback into a new recovery
epoch, the progress of the run (finished work, the run's end). Each is done between two calls
into the node: control messages reach the worker's one event queue in order with the data, and the
worker hands each to its handler (worker.py keeps the table: `Sync` goes to `syncs.py`, `Wire`,
`Connect`/`Disconnect` and `Stop` to the worker and its outputs).

    orders = OrderTaker(path, state, steps, version, fence, ...)
    await orders.ticket(m.TicketMsg(...))    # a source's work: through the data path
    await orders.enter_epoch(m.Epoch(...))   # stale work dropped, the committed checkpoint restored
    await orders.progress(m.Progress(...))   # finished work forgotten, the run's end moved
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from flowrl.node import Ticket
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker.datapath import DataPath
from flowrl.runtime.worker.inputs import Fence
from flowrl.runtime.worker.nodestate import NodeState
from flowrl.runtime.worker.ranks import GroupStep
from flowrl.runtime.worker.shape import Shape
from flowrl.runtime.worker.steps import GroupSteps
from flowrl.runtime.worker.version import WeightVersion


class OrderTaker:
    """Turns the controller's orders into calls on the data path, the node state and the group steps."""

    def __init__(self, path: DataPath, state: NodeState, steps: GroupSteps, version: WeightVersion, fence: Fence,
                 *, shape: Shape, rank: int, report: Callable[[Any], Awaitable[None]]):
        self._path = path
        self._state = state
        self._steps = steps
        self._version = version
        self._fence = fence
        self._shape = shape
        self._rank = rank
        self._report = report

    @property
    def epoch(self) -> int:
        """The recovery epoch this process is in (entered by `enter_epoch` only)."""
        return self._fence.epoch

    async def ticket(self, msg: m.TicketMsg) -> None:
        ticket = Ticket(batch_id=msg.batch_id, index=msg.index, attempt=msg.attempt,
                        min_policy_version=msg.min_policy_version, size=msg.size, epoch=msg.epoch)
        await self._path.on_arrival((None, ticket, None))

    async def progress(self, msg: m.Progress) -> None:
        self._path.forget_below(msg.complete_below)
        await self.extend_to(msg.steps)

    async def extend_to(self, steps: int) -> None:
        """The run's end moved (replaced tickets): its final checkpoint is at the new end; if this
        node got there before it heard, it saves now (its state is the state after `steps`)."""
        if not self._state.move_end(steps):
            return
        if self._rank > 0:  # a follower saves when its leader says (the step reaches it as a marker)
            return
        if self._path.watermark == steps and not self._state.saved(steps):
            await self._steps.take(GroupStep(checkpoint=steps), self._fence.epoch, marker="end")

    async def enter_epoch(self, msg: m.Epoch) -> None:
        """A stateful node restarted somewhere: drop everything of the old epoch, roll back."""
        if msg.epoch <= self._fence.epoch:  # an order sent again: we are there already, nothing changes
            await self._report(m.Recovered(epoch=self._fence.epoch))
            return
        await self._path.reset(msg)
        if self._shape.stateful:
            self._state.expect_restore(msg)
        if self._shape.subscribes:
            self._version.forget()  # hold every batch until the publisher's restored weights arrive
        held = self._fence.enter(msg.epoch)
        await self._report(m.Recovered(epoch=msg.epoch))
        if self._shape.stateful and self._rank == 0:
            # the state is restored by a step every rank takes at the leader's word (a fresh node or
            # a weight snapshot may run collectives); with nothing committed, the state right after
            # setup is saved as the epoch's first checkpoint. Followers take it from their shard channel.
            await self._steps.take_rollback(GroupStep(restore=True, checkpoint=None if msg.checkpoint else msg.watermark),
                                            msg.epoch)
        for arrival in held:
            await self._path.on_arrival(arrival)
