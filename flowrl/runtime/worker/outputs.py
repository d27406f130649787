"""The output side of a node process: stamping what the node returned, sending it on every output
edge, reporting a sink's consumption, and following consumer replicas added or removed.

    outputs.add(route, sender)                       # at wiring (worker.py), one per output edge
    batch = outputs.stamp(out, item)                 # the routing facts of the work it came from
    await outputs.emit({"out": batch}, item)
    await outputs.consume(item, dropped=None)        # a sink: `Consumed` to the controller
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from flowrl.node import Drop
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker.faults import FaultInjector
from flowrl.runtime.worker.inputs import Item
from flowrl.runtime.worker.shape import Shape
from flowrl.runtime.worker.version import WeightVersion


class Outputs:
    """Owns the output channels (one `Sender` per edge) and what goes on them."""

    def __init__(self, node: str, shape: Shape, faults: FaultInjector, recorder, version: WeightVersion,
                 report: Callable[[Any], Awaitable[None]], labels: dict[str, str],
                 curve: Callable[[str | None], Any]):
        self._node = node
        self._shape = shape
        self._faults = faults
        self._recorder = recorder
        self._version = version
        self._report = report  # sends one control message to the controller
        self._labels = labels  # {edge string: metric label}
        self._curve = curve  # the CURVE settings to reach a consumer whose key is given
        self._senders: list = []  # (route, Sender)
        self.per_update = 1  # tickets per training update (`schedule.ticket: group`: batch_size)

    def add(self, route, tx) -> None:
        self._senders.append((route, tx))

    def channels(self) -> list:
        return [tx for _, tx in self._senders]

    def stamp(self, out, item: Item):
        """Outputs carry the routing facts of the work they came from."""
        from flowrl.transport import Batch

        src = item.batch if item.parts is None else next(iter(item.parts.values()))
        min_version = src.min_version if item.min_version is None else item.min_version
        pv = -1 if self._shape.source else src.policy_version
        if isinstance(out, Drop):
            if out.replace and item.drop is None and self.per_update > 1:
                from flowrl.runtime.worker.contract import NodeContractError

                raise NodeContractError(
                    f"node {self._node!r} returned Drop(replace=True) in a run with `schedule.ticket: group`: a "
                    "dropped group is left out of its update (the update trains on the others), there is no "
                    "later batch to fill. Return a plain Drop, or use `ticket: batch` for a filter that holds "
                    "groups (DAPO)")
            if out.replace and item.drop is None and not self._shape.stateful:
                from flowrl.runtime.worker.contract import NodeContractError

                raise NodeContractError(
                    f"node {self._node!r} returned Drop(replace=True) but is not stateful: what it holds for a "
                    "later ticket would be lost when it restarts. Set `stateful = True` and save what it holds "
                    "in state_dict, or return a plain Drop")
            reason = out.reason if item.drop is not None else \
                Drop(f"{self._node}: {out.reason}", replace=out.replace).marker
            return Batch(batch_id=item.batch_id, attempt=item.attempt, index=item.index, min_version=min_version,
                         epoch=item.epoch, drop=reason[:1000], policy_version=pv)
        return out.replace(batch_id=item.batch_id, attempt=item.attempt, index=item.index, min_version=min_version,
                           epoch=item.epoch, policy_version=out.policy_version if out.policy_version >= 0 else pv)

    async def emit(self, outputs: dict, item: Item) -> None:
        for route, tx in self._senders:
            batch = outputs[route.port]
            forged = self._faults.forged(batch)
            if forged is not None:
                await tx.send(forged)
            if await self._faults.on_send(route.addresses, batch):
                continue
            with self._recorder.span("wait_credit", batch_id=batch.batch_id):
                await tx.send(batch)
            label = self._labels.get(route.edge, route.edge)
            self._recorder.count("channel_bytes", batch.nbytes, edge=label)
            self._recorder.count("channel_messages", 1, edge=label)

    async def consume(self, item: Item, dropped: Drop | None) -> None:
        """A sink took `item` (or its drop marker): the controller's ledger records it."""
        batch = item.batch if item.parts is None else next(iter(item.parts.values()))
        pv = batch.policy_version
        staleness = self._version.value - pv if pv >= 0 and dropped is None else 0
        if dropped is None:
            self._recorder.max("staleness", staleness)
            self._recorder.observe("staleness", staleness)
        self._recorder.sample_cpu(start=False)  # (every 0.2 s at most) the rows' thread CPU keeps up with their spans
        await self._report(m.Consumed(batch_id=item.batch_id, attempt=item.attempt, index=item.index,
                                      epoch=item.epoch, policy_version=pv, staleness=staleness,
                                      dropped_by=dropped.reason if dropped else None, metrics=self._recorder.drain()))

    async def rewire(self, msg: m.Connect | m.Disconnect) -> None:
        """A consumer replica was added or removed (`flowrl scale`)."""
        for route, tx in self._senders:
            if route.edge != msg.edge:
                continue
            if isinstance(msg, m.Connect) and msg.address not in route.addresses:
                route.addresses.append(msg.address)
                if msg.key:
                    route.keys[msg.address] = msg.key
                await tx.connect(msg.address, wait=False, curve=self._curve(msg.key))
            elif isinstance(msg, m.Disconnect) and msg.address in route.addresses:
                route.addresses.remove(msg.address)
                for batch in await tx.disconnect(msg.address):  # not acknowledged there: to the others
                    await tx.send(batch)
