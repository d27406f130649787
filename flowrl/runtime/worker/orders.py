"""The controller's orders (mixed into `Worker`): what each one does between two calls into the node.

Control messages reach the worker's one event queue in order with the data; `on_control` acts on
each: a ticket goes to the data path (`datapath.py`), `Sync` to the weight side (`nodestate.py`),
`Epoch` rolls the node back into a new recovery epoch (stale work dropped, the committed
checkpoint loaded), `Progress` forgets finished work and moves the run's end, `Wire` connects the
outputs, `Connect`/`Disconnect` follow a consumer replica added or removed, `Stop` ends the loop.
"""

from __future__ import annotations

from flowrl.node import Ticket
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker.ranks import GroupStep


class OrderTaker:
    """The worker's control half: `on_control` and the orders that change its state."""

    async def on_control(self, msg) -> None:
        if isinstance(msg, m.TicketMsg):
            ticket = Ticket(batch_id=msg.batch_id, index=msg.index, attempt=msg.attempt,
                            min_policy_version=msg.min_policy_version, size=msg.size, epoch=msg.epoch)
            await self.on_arrival((None, ticket, None))
        elif isinstance(msg, m.Sync):
            await self.weight_sync(msg)
        elif isinstance(msg, m.Epoch):
            await self.enter_epoch(msg)
        elif isinstance(msg, m.Progress):
            self.forget_below(msg.complete_below)
            await self.extend_to(msg.steps)
        elif isinstance(msg, m.Wire):
            await self.wire(msg.routes)
        elif isinstance(msg, (m.Connect, m.Disconnect)):
            await self.rewire(msg)
        elif isinstance(msg, m.Stop):
            self.stopping = True

    async def rewire(self, msg) -> None:
        """A consumer replica was added or removed (`flowrl scale`)."""
        for route, tx in self.senders:
            if route.edge != msg.edge:
                continue
            if isinstance(msg, m.Connect) and msg.address not in route.addresses:
                route.addresses.append(msg.address)
                if msg.key:
                    route.keys[msg.address] = msg.key
                await tx.connect(msg.address, wait=False, curve=self.output_curve(msg.key))
            elif isinstance(msg, m.Disconnect) and msg.address in route.addresses:
                route.addresses.remove(msg.address)
                for batch in await tx.disconnect(msg.address):  # not acknowledged there: to the others
                    await tx.send(batch)

    async def extend_to(self, steps: int) -> None:
        """The run's end moved (replaced tickets): its final checkpoint is at the new end; if this
        node got there before it heard, it saves now (its state is the state after `steps`)."""
        if steps == self.steps:
            return
        self.steps = steps
        if self.spec.rank > 0:  # a follower saves when its leader says (the step reaches it as a marker)
            return
        if self.ordered is not None and self.ordered.watermark == steps and self.saved_at != (self.fence.epoch, steps):
            step = GroupStep(checkpoint=steps)
            if not self.dp or await self.lead(None, step, epoch=self.fence.epoch, marker="end"):
                await self.follow(step)

    def forget_below(self, index: int) -> None:
        if self.cache is not None:
            self.cache.forget_below(index)
        if self.joins is not None:
            self.joins.forget_below(index)

    async def enter_epoch(self, msg: m.Epoch) -> None:
        """A stateful node restarted somewhere: drop everything of the old epoch, roll back."""
        if msg.epoch <= self.fence.epoch:  # an order sent again: we are there already, nothing changes
            await self.send_ctl(m.Recovered(epoch=self.fence.epoch))
            return
        stale = [(r, b, "recovery") for _, b, r in self.gate.clear()]
        if self.joins is not None:
            stale += self.joins.clear()
        for r, b, why in stale:
            await self.discard(r, b, why)
        if self.stateful:
            for item in self.ordered.reset(msg.watermark):  # already acked when buffered
                await self.send_ctl(m.Duplicate(batch_id=item.batch_id, attempt=item.attempt, why="recovery"))
            self.cache and self.cache.clear()
            self.restore_orders[msg.epoch] = msg
        if self.seen is not None:
            self.seen.reset(msg.watermark, msg.consumed)
        if self.cls.subscribes_weights:
            self.version = -1  # hold every batch until the publisher's restored weights arrive
        held = self.fence.enter(msg.epoch)
        await self.send_ctl(m.Recovered(epoch=msg.epoch))
        if self.stateful and self.spec.rank == 0:
            # the state is restored by a step every rank takes at the leader's word (a fresh node or
            # a weight snapshot may run collectives); with nothing committed, the state right after
            # setup is saved as the epoch's first checkpoint. Followers take it from their shard channel.
            step = GroupStep(restore=True, checkpoint=None if msg.checkpoint else msg.watermark)
            if self.dp and not self.wired:  # no channel to the followers yet: restore once wired
                self.deferred_restore = (step, msg.epoch)
            elif not self.dp or await self.lead(None, step, epoch=msg.epoch):
                await self.follow(step)
        for arrival in held:
            await self.on_arrival(arrival)
