"""The data path of a node process (mixed into `Worker`): from an arrival to the outputs sent.

Each batch or ticket taken off the event queue passes the node shape's input policies
(`inputs.py`): the recovery-epoch fence, the version gate of subscribers, the declared tensors,
the join buffer, in-order delivery with an output cache for stateful nodes (a ticket already
applied is answered from the cache) and once-only consumption for sinks. Then the node is called
once (on the compute thread), its outputs are stamped with the routing facts of the work they came
from and sent on every output edge, or, at a sink, the consumption is reported to the controller.
Then the node follows the ticket's `GroupStep` (a trainer publishes its new weights, a stateful node
saves its checkpoint), decided in one place (`after_ticket`) for every rank. Input credit is
acknowledged here, and duplicates are reported.
"""

from __future__ import annotations

import logging
import time

from flowrl.node import Drop
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker.inputs import Item
from flowrl.runtime.worker.ranks import SHARD, SKIPPED, FENCED, GroupStep

log = logging.getLogger("flowrl.worker")


class DataPath:
    """The worker's data half: admit, run, stamp, emit, consume, acknowledge."""

    async def on_arrival(self, arrival) -> None:
        """One batch (port, batch, rx) or ticket (None, ticket, None) from the event queue."""
        port, work, rx = arrival
        if port == SHARD:
            if self.fence.classify(work.epoch) == "future":  # the leader entered a recovery epoch first
                self.fence.future.append(arrival)
                return
            await self.on_shard(work, rx)
            return
        verdict = self.fence.classify(work.epoch)
        if verdict == "stale":
            if rx is not None:
                await self.discard(rx, work, "stale epoch")
            return
        if verdict == "future":
            self.fence.future.append(arrival)
            return
        if rx is not None and self.cls.subscribes_weights and work.drop is None \
                and not self.gate.admits(work.min_version, self.version):
            self.gate.hold(arrival)  # generated later, once the weights arrive
            return
        if rx is not None and work.drop is None and self.cls.requires:
            problem = missing_tensors(work, self.cls.requires)
            if problem:
                self.recorder.count("batches_rejected", 1, edge=self.input_labels.get(port, port))
                log.warning("rejected batch %s on %s: %s", work.batch_id, port, problem)
                await self.discard(rx, work, f"invalid: {problem}")
                return
        if rx is None:
            item = Item(work.index, work.batch_id, work.attempt, work.epoch, None, work,
                        min_version=work.min_policy_version)
        elif self.is_join:
            item, drops = self.joins.offer(port, work, rx)
            for r, b, why in drops:
                await self.discard(r, b, why)
            if item is None:
                # a held part gives its credit back now, as buffered work does: otherwise parts of
                # different tickets held on each port (after a re-issue reorders them) can use up
                # both ports' credit while each waits for a partner behind the other's (a deadlock).
                # A join that dies loses nothing: its restart re-issues the open tickets.
                await rx.ack(work)
                return
        else:
            item = Item.of_batch(port, work, rx)
        await self.admit(item)

    async def admit(self, item: Item) -> None:
        if self.ordered is not None:
            verdict = self.ordered.offer(item)
            if verdict != "buffered":
                await self.replay(item) if verdict == "replay" else await self.discard_item(item, "duplicate")
                return
            await self.ack(item)  # buffered work gives its credit back now: order never blocks a channel
            while (nxt := self.ordered.next_ready()) is not None:
                step = await self.run(nxt)
                self.ordered.done(nxt.index)
                await self.follow(step)
            return
        if self.seen is not None and not self.seen.first_time(item.index):
            await self.discard_item(item, "already consumed by this sink")
            return
        step = await self.run(item)
        await self.ack(item)
        await self.follow(step)

    async def replay(self, item: Item) -> None:
        """A ticket this stateful node already applied: send its output again, state untouched."""
        cached = self.cache.get(item.index) if self.cache is not None else None
        await self.ack(item)
        if cached is None:
            await self.send_ctl(m.Duplicate(batch_id=item.batch_id, attempt=item.attempt, why="already applied"))
            return
        await self.emit({p: b if isinstance(b, Drop) else b.replace(attempt=item.attempt) for p, b in cached.items()},
                        item)

    def after_ticket(self, item: Item) -> GroupStep:
        """What follows `item` on every rank of this node: the one place that decides it (followers
        get the leader's decision with their shard, `ranks.py`)."""
        after = item.index + 1  # the in-order watermark once `item` is applied
        return GroupStep(publish=self.cls.publishes_weights and self.is_sink,
                         checkpoint=after if self.ordered is not None and self.is_checkpoint_step(after) else None)

    async def call_node(self, batch_id: str, hook, *args):
        """One call into the node, on its compute thread; `busy` says which, since when (the heartbeat
        thread reports it: a call past `process_timeout_s` is a hung node)."""
        outer, self.busy = self.busy, self.busy or (batch_id, time.monotonic())
        try:
            await self.faults.on_batch(self.step)
            self.step += 1
            stall = self.faults.stall(self.step - 1)
            if stall:  # a wedged call: the compute thread is stuck, the loop and heartbeats go on
                await self.compute.call(time.sleep, stall)
            with self.recorder.span("compute", batch_id=batch_id):
                return await self.compute.call(hook, *args)
        except BaseException:
            self.failed_on = batch_id  # named on the last-error line
            raise
        finally:
            self.busy = outer

    async def run(self, item: Item) -> GroupStep:
        """Call the node once for `item` and send what it returned (or the drop marker). Returns
        what follows the ticket on every rank (`follow`)."""
        from flowrl.runtime.worker.contract import outputs_of

        if self.step == 0 and item.drop is None:
            log.info("first batch %.2f s after start (at %.6f)", time.monotonic() - self.t_start, time.time())
        step = self.after_ticket(item)
        if item.drop is not None:  # a drop marker passes through without a call, on every output
            result = Drop(item.drop) if self.is_sink else {p: Drop(item.drop) for p in self.cls.outputs}
            if self.dp and not await self.lead(item, step, epoch=item.epoch):  # followers follow drops too
                result = SKIPPED
        else:
            method = "generate" if self.is_source else "join" if self.is_join else "process"
            if self.is_source:
                result = await self.call_node(item.batch_id, self.node.generate, item.batch)
            elif self.is_join:
                result = await self.call_node(item.batch_id, self.node.join, item.parts)
            elif self.dp:
                self.busy = (item.batch_id, time.monotonic())  # waiting for the followers counts too
                try:
                    result = await self.run_ranks(item, step, method)
                finally:
                    self.busy = None
            else:
                result = await self.call_node(item.batch_id, self.node.process, item.batch, item.port)
            if result is not SKIPPED:
                result = None if self.is_sink else \
                    outputs_of(result, node=self.spec.node, method=method, ports=self.cls.outputs)
        if result is SKIPPED:
            # a rank is in a newer recovery epoch: nobody ran the ticket, and nothing of it goes on
            # (a drop marker would be counted as a real drop by a sink that has not heard of the
            # recovery yet); the recovery that is under way re-issues it
            await self.send_ctl(m.Duplicate(batch_id=item.batch_id, attempt=item.attempt, why=FENCED))
            return SKIPPED
        if self.is_sink:
            await self.consume(item, result if isinstance(result, Drop) else None)
            return step
        outputs = {p: self.stamp(b, item) for p, b in result.items()}
        await self.emit(outputs, item)
        if self.cache is not None:
            self.cache.put(item.index, outputs)
        return step

    async def follow(self, step: GroupStep, epoch: int | None = None) -> None:
        """Do what follows a ticket (or a rollback) on this rank, in the order every rank does it.
        `epoch`: the step's recovery epoch (default: this rank's)."""
        if step.restore:
            await self.restore(self.fence.epoch if epoch is None else epoch)
        if step.publish:
            self.version += 1
            self.nctx.policy_version = self.version
            await self.publish_snapshot()
            if self.weights is not None:  # the publisher (rank 0) announces the version
                await self.send_ctl(m.Published(version=self.version, epoch=self.fence.epoch, **self.weights.digest()))
        if step.checkpoint is not None:
            await self.save_checkpoint(step.checkpoint)
        if step.sync is not None:
            await self.join_sync(step.sync)

    def stamp(self, out, item: Item):
        """Outputs carry the routing facts of the work they came from."""
        from flowrl.transport import Batch

        src = item.batch if item.parts is None else next(iter(item.parts.values()))
        min_version = src.min_version if item.min_version is None else item.min_version
        pv = -1 if self.is_source else src.policy_version
        if isinstance(out, Drop):
            if out.replace and item.drop is None and not self.stateful:
                from flowrl.runtime.worker.contract import NodeContractError

                raise NodeContractError(
                    f"node {self.spec.node!r} returned Drop(replace=True) but is not stateful: what it holds for a "
                    "later ticket would be lost when it restarts. Set `stateful = True` and save what it holds "
                    "in state_dict, or return a plain Drop")
            reason = out.reason if item.drop is not None else \
                Drop(f"{self.spec.node}: {out.reason}", replace=out.replace).marker
            return Batch(batch_id=item.batch_id, attempt=item.attempt, index=item.index, min_version=min_version,
                         epoch=item.epoch, drop=reason[:1000], policy_version=pv)
        return out.replace(batch_id=item.batch_id, attempt=item.attempt, index=item.index, min_version=min_version,
                           epoch=item.epoch, policy_version=out.policy_version if out.policy_version >= 0 else pv)

    async def emit(self, outputs: dict, item: Item) -> None:
        for route, tx in self.senders:
            batch = outputs[route.port]
            forged = self.faults.forged(batch)
            if forged is not None:
                await tx.send(forged)
            if await self.faults.on_send(route.addresses, batch):
                continue
            with self.recorder.span("wait_credit", batch_id=batch.batch_id):
                await tx.send(batch)
            label = self.output_labels.get(route.edge, route.edge)
            self.recorder.count("channel_bytes", batch.nbytes, edge=label)
            self.recorder.count("channel_messages", 1, edge=label)

    async def consume(self, item: Item, dropped: Drop | None) -> None:
        batch = item.batch if item.parts is None else next(iter(item.parts.values()))
        pv = batch.policy_version
        staleness = self.version - pv if pv >= 0 and dropped is None else 0
        if dropped is None:
            self.recorder.max("staleness", staleness)
            self.recorder.observe("staleness", staleness)
        await self.send_ctl(m.Consumed(batch_id=item.batch_id, attempt=item.attempt, index=item.index,
                                       epoch=item.epoch, policy_version=pv, staleness=staleness,
                                       dropped_by=dropped.reason if dropped else None, metrics=self.recorder.drain()))


    async def ack(self, item: Item) -> None:
        for rx, batch in item.acks:
            await rx.ack(batch)
        item.acks = []

    async def discard(self, rx, batch, why: str) -> None:
        await rx.ack(batch)
        await self.send_ctl(m.Duplicate(batch_id=batch.batch_id, attempt=batch.attempt, why=why))

    async def discard_item(self, item: Item, why: str) -> None:
        await self.ack(item)
        await self.send_ctl(m.Duplicate(batch_id=item.batch_id, attempt=item.attempt, why=why))


def missing_tensors(batch, requires: dict) -> str | None:
    """What a batch lacks of a node's declared input, or None."""
    from flowrl.transport.dtypes import dtype_name

    for name, dtype in requires.items():
        t = batch.tensors.get(name)
        if t is None:
            return f"no tensor {name!r} (has {sorted(batch.tensors)[:8]})"
        if dtype is not None and dtype_name(t) != dtype:
            return f"tensor {name!r} is {dtype_name(t)}, the node takes {dtype}"
    return None
