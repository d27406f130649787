"""The data path of a node process: from an arrival to the outputs sent.

Each batch or ticket taken off the event queue passes the node shape's input policies
(`inputs.py`): the recovery-epoch fence, the version gate of subscribers, the declared tensors,
the join buffer, in-order delivery with an output cache for stateful nodes (a ticket already
applied is answered from the cache) and once-only consumption for sinks. Then the node is called
once (on the compute thread, `runner.py`), its outputs are stamped with the routing facts of the
work they came from and sent on every output edge (`outputs.py`), or, at a sink, the consumption is
reported to the controller. Then the node follows the ticket's `GroupStep` (a trainer publishes its
new weights, a stateful node saves its checkpoint), decided in one place (`after_ticket`) for every
rank (`steps.py`). Input credit is acknowledged here, and duplicates are reported.

    path = DataPath(shape, policies, runner=..., outputs=..., steps=..., ...)
    await path.on_arrival(("in", batch, rx))          # a batch from input port "in"
    await path.on_arrival((None, ticket, None))       # a ticket from the controller
    await path.on_arrival((SHARD, shard, rank_rx))    # a follower rank's shard from its leader
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from flowrl.node import Drop
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker.concurrent import Concurrent
from flowrl.runtime.worker.contract import outputs_of
from flowrl.runtime.worker.inputs import Item, Policies
from flowrl.runtime.worker.nodestate import NodeState
from flowrl.runtime.worker.outputs import Outputs
from flowrl.runtime.worker.ranks import FENCED, SHARD, SKIPPED, GroupStep, RankGroup
from flowrl.runtime.worker.runner import NodeRunner
from flowrl.runtime.worker.shape import Shape
from flowrl.runtime.worker.steps import GroupSteps
from flowrl.runtime.worker.version import WeightVersion

log = logging.getLogger("flowrl.worker")


class DataPath:
    """The worker's data half: admit, run, stamp, emit, consume, acknowledge. Owns the input
    policies' decisions (the `Policies` objects hold their state)."""

    def __init__(self, shape: Shape, policies: Policies, *, node: str, runner: NodeRunner, outputs: Outputs,
                 steps: GroupSteps, state: NodeState, ranks: RankGroup | None, version: WeightVersion, recorder,
                 report: Callable[[Any], Awaitable[None]], labels: dict[str, str], started: float,
                 concurrency: int = 1, max_staleness: int | None = None):
        self._shape = shape
        self._p = policies
        self._node = node
        self._runner = runner
        self._outputs = outputs
        self._steps = steps
        self._state = state  # which watermarks are checkpoint steps
        self._ranks = ranks  # this rank's data-parallel group (None: one rank)
        self._version = version
        self._recorder = recorder
        self._report = report
        self._labels = labels  # {input port: metric label}
        self._started = started  # the process's start (monotonic), for the first batch's log line
        # a trainer refuses a group older than the bound (on its oldest token) at its input
        self._max_staleness = max_staleness if shape.publishes and shape.sink and shape.stateful else None
        self.calls = Concurrent(concurrency) if concurrency > 1 else None  # several calls at once

    @property
    def watermark(self) -> int | None:
        """A stateful node's in-order watermark (None: not stateful)."""
        return self._p.ordered.watermark if self._p.ordered is not None else None

    async def on_arrival(self, arrival) -> None:
        """One batch (port, batch, rx) or ticket (None, ticket, None) from the event queue."""
        port, work, rx = arrival
        fence = self._p.fence
        if port == SHARD:
            if fence.classify(work.epoch) == "future":  # the leader entered a recovery epoch first
                fence.hold(arrival)
                return
            follow_up = await self._ranks.on_shard(work, rx)
            if follow_up is not None:
                if follow_up.watermark is not None and self._p.ordered is not None:
                    self._p.ordered.follow_leader(follow_up.watermark)
                await self._steps.follow(follow_up.step, epoch=follow_up.epoch, keep=follow_up.keep)
            return
        verdict = fence.classify(work.epoch)
        if verdict == "stale":
            if rx is not None:
                await self.discard(rx, work, "stale epoch")
            return
        if verdict == "future":
            fence.hold(arrival)
            return
        if self._shape.subscribes and (rx is None or work.drop is None) \
                and not self._p.gate.admits(work.min_version, self._version.value):
            self._p.gate.hold(arrival)  # generated later, once the weights arrive (a batch, or a
            return                      # ticket of a source that subscribes: a prompt source fused in)
        if rx is not None and work.drop is None and self._shape.requires:
            problem = missing_tensors(work, self._shape.requires)
            if problem:
                edge = self._labels.get(port, port)
                self._recorder.count("batches_rejected", 1, edge=edge)
                log.warning("rejected batch %s on %s: %s", work.batch_id, port, problem)
                await self.discard(rx, work, f"{m.INVALID} on {edge}: {problem}")  # the controller says it at once
                return
        if rx is None:
            item = Item(work.index, work.batch_id, work.attempt, work.epoch, None, work,
                        min_version=work.min_policy_version)
        elif self._shape.join:
            item, drops = self._p.joins.offer(port, work, rx)
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
        ordered, seen = self._p.ordered, self._p.seen
        if ordered is not None:
            verdict = ordered.offer(item)
            if verdict != "buffered":
                await self.replay(item) if verdict == "replay" else await self.discard_item(item, "duplicate")
                return
            await self.ack(item)  # buffered work gives its credit back now: order never blocks a channel
            if ordered.per_update > 1:  # a trainer with `ticket: group`: the groups of one update together
                while (update := ordered.next_update(self._state.steps)) is not None:
                    step = await self.run_update(update)
                    ordered.done(update[-1].index)
                    await self._steps.follow(step)
                return
            while (nxt := ordered.next_ready()) is not None:  # batch tickets: staleness measured, not
                step = await self.run(nxt)  # enforced (a DAPO filter may hold groups older than the bound)
                ordered.done(nxt.index)
                await self._steps.follow(step)
            return
        if seen is not None and not seen.first_time(item.index):
            await self.discard_item(item, "already consumed by this sink")
            return
        if self.calls is not None:  # `concurrency`: the call runs beside the others, the loop goes on
            await self.calls.start(self.run_stateless, item)
            return
        await self.run_stateless(item)

    async def run_stateless(self, item: Item) -> None:
        step = await self.run(item)
        await self.ack(item)
        await self._steps.follow(step)

    async def run_update(self, items: list[Item]) -> GroupStep:
        """One training update from the tickets of `items` (in order): a call with their batches
        concatenated (drop markers and groups past the staleness bound left out), then each ticket
        consumed on its own."""
        for it in items:
            self.refuse_stale(it)
        live = [it for it in items if it.drop is None]
        last = items[-1]
        if not live:
            return await self.run(last, consumed=items)
        from flowrl.transport import Batch

        batch = Batch.concat([it.batch for it in live], batch_id=last.batch_id, attempt=last.attempt,
                             index=last.index, epoch=last.epoch) if len(live) > 1 else live[0].batch
        merged = Item(last.index, last.batch_id, last.attempt, last.epoch, live[-1].port, batch)
        return await self.run(merged, consumed=items)

    def refuse_stale(self, item: Item) -> None:
        """A trainer's input: a group whose oldest token is more than `max_staleness` versions behind
        the weights it would train is dropped (never reached with the scheduler's gates; a guard)."""
        if self._max_staleness is None or item.drop is not None or item.batch is None:
            return
        pv, now = item.batch.policy_version, self._version.value
        if pv >= 0 and now - pv > self._max_staleness:
            self._recorder.count("stale_dropped", 1)
            log.warning("dropped %s: its oldest token is from version %d, %d behind %d (max_staleness %d)",
                        item.batch_id, pv, now - pv, now, self._max_staleness)
            item.drop = f"{self._node}: stale (version {pv}, {now - pv} behind, max_staleness {self._max_staleness})"

    async def replay(self, item: Item) -> None:
        """A ticket this stateful node already applied: send its output again, state untouched."""
        cached = self._p.cache.get(item.index) if self._p.cache is not None else None
        await self.ack(item)
        if cached is None:
            await self._report(m.Duplicate(batch_id=item.batch_id, attempt=item.attempt, why="already applied"))
            return
        await self._outputs.emit({p: b if isinstance(b, Drop) else b.replace(attempt=item.attempt)
                                  for p, b in cached.items()}, item)

    def after_ticket(self, item: Item) -> GroupStep:
        """What follows `item` on every rank of this node: the one place that decides it (followers
        get the leader's decision with their shard, `ranks.py`)."""
        after = item.index + 1  # the in-order watermark once `item` is applied
        return GroupStep(publish=self._shape.publishes and self._shape.sink,
                         checkpoint=after if self._p.ordered is not None and self._state.is_checkpoint_step(after)
                         else None)

    async def run(self, item: Item, consumed: list[Item] | None = None) -> GroupStep:
        """Call the node once for `item` and send what it returned (or the drop marker). Returns
        what follows the ticket on every rank (`GroupSteps.follow`). A sink reports each ticket of
        `consumed` (the tickets of one update) instead of `item`."""
        shape, node = self._shape, self._runner.node
        if self._runner.calls == 0 and item.drop is None:
            log.info("first batch %.2f s after start (at %.6f)", time.monotonic() - self._started, time.time())
        step = self.after_ticket(item)
        if item.drop is not None:  # a drop marker passes through without a call, on every output
            result = Drop(item.drop) if shape.sink else {p: Drop(item.drop) for p in shape.outputs}
            if self._ranks is not None and not await self._ranks.lead(item, step, epoch=item.epoch):
                result = SKIPPED  # followers follow drops too
        else:
            method = "generate" if shape.source else "join" if shape.join else "process"
            if shape.source:
                result = await self._runner.call(item.batch_id, node.generate, item.batch)
            elif shape.join:
                result = await self._runner.call(item.batch_id, node.join, item.parts)
            elif self._ranks is not None:
                with self._runner.occupied(item.batch_id):  # waiting for the followers counts too
                    result = await self._ranks.run_ranks(item, step, method)
            else:
                result = await self._runner.call(item.batch_id, node.process, item.batch, item.port)
            if result is not SKIPPED:
                result = None if shape.sink else outputs_of(result, node=self._node, method=method, ports=shape.outputs)
        if result is SKIPPED:
            # a rank is in a newer recovery epoch: nobody ran the ticket, and nothing of it goes on
            # (a drop marker would be counted as a real drop by a sink that has not heard of the
            # recovery yet); the recovery that is under way re-issues it
            await self._report(m.Duplicate(batch_id=item.batch_id, attempt=item.attempt, why=FENCED))
            return SKIPPED
        if shape.sink:
            for it in consumed or [item]:
                dropped = Drop(it.drop) if consumed and it.drop is not None else result if isinstance(result, Drop) else None
                await self._outputs.consume(it, dropped)
            return step
        outputs = {p: self._outputs.stamp(b, item) for p, b in result.items()}
        await self._outputs.emit(outputs, item)
        if self._p.cache is not None:
            self._p.cache.put(item.index, outputs)
        return step

    async def release(self, version: int) -> None:
        """A subscriber now holds `version`: the batches that waited for it go on."""
        for arrival in self._p.gate.release(version):
            await self.on_arrival(arrival)

    async def reset(self, order: m.Epoch) -> None:
        """A rollback into `order.epoch`: the held and buffered work of the old epoch is dropped (and
        acked, so credit returns), the in-order and sink watermarks are the order's."""
        stale = [(r, b, "recovery") for _, b, r in self._p.gate.clear() if r is not None]  # tickets: re-issued
        if self._p.joins is not None:
            stale += self._p.joins.clear()
        for r, b, why in stale:
            await self.discard(r, b, why)
        if self.calls is not None:
            for item in self.calls.drop_waiting():
                await self.discard_item(item, "recovery")
        if self._p.ordered is not None:
            for item in self._p.ordered.reset(order.watermark):  # already acked when buffered
                await self._report(m.Duplicate(batch_id=item.batch_id, attempt=item.attempt, why="recovery"))
        if self._p.cache is not None:
            self._p.cache.clear()
        if self._p.seen is not None:
            self._p.seen.reset(order.watermark, order.consumed)

    def forget_below(self, index: int) -> None:
        """Every sink has each ticket below `index`: its cached outputs and join records go."""
        if self._p.cache is not None:
            self._p.cache.forget_below(index)
        if self._p.joins is not None:
            self._p.joins.forget_below(index)

    async def ack(self, item: Item) -> None:
        for rx, batch in item.acks:
            await rx.ack(batch)
        item.acks = []

    async def discard(self, rx, batch, why: str) -> None:
        await rx.ack(batch)
        await self._report(m.Duplicate(batch_id=batch.batch_id, attempt=batch.attempt, why=why))

    async def discard_item(self, item: Item, why: str) -> None:
        await self.ack(item)
        await self._report(m.Duplicate(batch_id=item.batch_id, attempt=item.attempt, why=why))

    def dump(self) -> list[str]:
        """What the input policies hold (for `flowrl status --dump`)."""
        p = self._p
        lines = []
        if p.ordered is not None:
            lines.append(f"in order: watermark {p.ordered.watermark}, buffered {sorted(p.ordered.buffer)[:8]}")
        lines.append(f"held for weights: {[a[1].batch_id for a in p.gate.waiting][:8]}; "
                     f"future epochs: {len(p.fence.future)}")
        if self.calls is not None:
            lines.append(self.calls.dump())
        if p.joins is not None:
            lines.append(f"join parts: { {b: (a, i, sorted(ps)) for b, (a, i, ps) in list(p.joins.parts.items())[:8]} }")
        return lines


def missing_tensors(batch, requires: dict) -> str | None:
    """What a batch lacks of a node's declared input, or None (see `Node.requires` for the forms)."""
    from flowrl.transport.dtypes import dtype_name
    from flowrl.transport.ragged import Ragged

    for name, want in requires.items():
        t = batch.tensors.get(name)
        if t is None:
            return f"no tensor {name!r} (has {sorted(batch.tensors)[:8]})"
        if want is None:
            continue
        layout, _, dtype = want.rpartition(" ")
        ragged = type(t) is Ragged
        if layout == "ragged" and not ragged:
            return f"tensor {name!r} is rectangular {dtype_name(t)}{list(t.shape)}, the node takes it ragged " \
                   "(one sequence per sample: flowrl.Ragged)"
        if layout == "dense" and ragged:
            return f"tensor {name!r} is ragged, the node takes it rectangular (pad it with .to_padded())"
        got = dtype_name(t.values if ragged else t)
        if dtype and got != dtype:
            return f"tensor {name!r} is {got}, the node takes {dtype}"
    return None
