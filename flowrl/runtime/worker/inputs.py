"""Input policies of a node process: what to do with each batch that arrives, per node shape.

Each policy is a plain object that takes arrivals and returns decisions; the worker does the I/O
(acks, sends, calls into the node). They are unit-tested without processes.

    Fence          recovery epochs: a batch of an older epoch is dropped, of a newer one held
    VersionGate    weight subscribers: a batch waits until the weights it needs are loaded
    JoinBuffer     joins: parts gathered per (batch id, attempt); duplicates dropped (and acked)
    Ordered        stateful nodes: tickets in index order, each once; a ticket below the
                   watermark is a replay (its cached output is sent again, the state is untouched);
                   a trainer with `schedule.ticket: group` takes the tickets of one update together
    SinkSeen       stateless sinks: each ticket consumed once, across re-issues
    OutputCache    stateful transforms: outputs kept until every sink has the ticket
    Policies       the ones a node's shape uses

An `Item` is one unit of work: a ticket (sources), one batch (transforms, sinks) or the gathered
parts of a join. `drop` is set when the work is a drop marker (or a part of it is).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowrl.node import is_replace
from flowrl.runtime.protocol.indexset import IndexSet


@dataclass
class Item:
    index: int
    batch_id: str
    attempt: int
    epoch: int
    port: str | None = None
    batch: Any = None  # the Batch (transforms, sinks) or the Ticket (sources)
    parts: dict[str, Any] | None = None  # joins: port -> Batch
    acks: list = field(default_factory=list)  # (receiver, batch) to ack once handled
    drop: str | None = None
    min_version: int | None = None  # sources: the ticket's; others: their input batch's

    @classmethod
    def of_batch(cls, port: str, batch, rx) -> "Item":
        return cls(batch.index, batch.batch_id, batch.attempt, batch.epoch, port, batch,
                   acks=[(rx, batch)] if rx is not None else [], drop=batch.drop)


class Fence:
    """Recovery epochs. `classify` says whether a batch belongs to this epoch."""

    def __init__(self, epoch: int = 0):
        self.epoch = epoch
        self.future: list = []  # (port, batch, rx) of a newer epoch, held until it is entered

    def classify(self, epoch: int) -> str:
        if epoch < self.epoch:
            return "stale"
        return "future" if epoch > self.epoch else "ok"

    def hold(self, arrival) -> None:
        """Keep an arrival of a newer epoch until that epoch is entered."""
        self.future.append(arrival)

    def enter(self, epoch: int) -> list:
        """Enter `epoch`; returns held arrivals that now belong to it and those of an epoch it skipped
        (stale now: the caller's fence check drops and acks them); newer ones stay held."""
        self.epoch = epoch
        now = [f for f in self.future if f[1].epoch <= epoch]
        self.future = [f for f in self.future if f[1].epoch > epoch]
        return now


class VersionGate:
    """Batches wait here until the subscriber holds `min_version`."""

    def __init__(self):
        self.waiting: list = []

    def admits(self, min_version: int, version: int) -> bool:
        return min_version <= version

    def hold(self, arrival) -> None:
        self.waiting.append(arrival)

    def release(self, version: int) -> list:
        ready = [a for a in self.waiting if a[1].min_version <= version]
        self.waiting = [a for a in self.waiting if a[1].min_version > version]
        return ready

    def clear(self) -> list:
        out, self.waiting = self.waiting, []
        return out


class JoinBuffer:
    """Gathers one part per input port for each (batch id, attempt).

    A second copy of a part already held, a part of an attempt older than one seen, or a part of
    a batch already joined is dropped — and returned, so the worker acks it (credit returns)."""

    def __init__(self, ports: tuple[str, ...]):
        self.ports = ports
        self.parts: dict[str, tuple[int, int, dict[str, tuple]]] = {}  # bid -> (attempt, index, port -> (batch, rx))
        self.joined: dict[str, tuple[int, int]] = {}  # bid -> (attempt, index) of the last join made

    def offer(self, port: str, batch, rx) -> tuple[Item | None, list[tuple]]:
        """-> (a complete Item or None, [(rx, batch, why)] to ack and drop)."""
        bid, attempt = batch.batch_id, batch.attempt
        done = self.joined.get(bid)
        if done is not None and attempt <= done[0]:
            return None, [(rx, batch, "already joined")]
        held = self.parts.get(bid)
        drops = []
        if held is not None and held[0] != attempt:
            if attempt < held[0]:
                return None, [(rx, batch, "older attempt")]
            drops = [(r, b, "superseded attempt") for b, r in held[2].values()]
            held = None
        if held is None:
            held = self.parts[bid] = (attempt, batch.index, {})
        if port in held[2]:
            return None, drops + [(rx, batch, "duplicate part")]
        held[2][port] = (batch, rx)
        if len(held[2]) < len(self.ports):
            return None, drops
        del self.parts[bid]
        self.joined[bid] = (attempt, batch.index)
        parts = {p: held[2][p][0] for p in self.ports}  # port order, not arrival order
        markers = [b.drop for b in parts.values() if b.drop is not None]
        # the same marker whichever part came first; one asking for a replacement wins
        drop = next((d for d in markers if is_replace(d)), markers[0] if markers else None)
        item = Item(batch.index, bid, attempt, batch.epoch, None, None, parts,
                    acks=[(r, b) for b, r in held[2].values()], drop=drop)
        return item, drops

    def forget_below(self, index: int) -> None:
        self.joined = {b: v for b, v in self.joined.items() if v[1] >= index}

    def clear(self) -> list[tuple]:
        out = [(r, b, "recovery") for _, _, parts in self.parts.values() for b, r in parts.values()]
        self.parts, self.joined = {}, {}
        return out


class Ordered:
    """Tickets in index order from `watermark`, each once. `offer` buffers an item; `next_ready`
    hands out the item at the watermark; `done` moves the watermark past it.

    With `per_update > 1` (a trainer, `schedule.ticket: group`) `next_update` hands out the tickets
    of the update at the watermark together, once every one of them is here: tickets
    `[u * per_update, (u + 1) * per_update)` (or up to the run's end). The watermark stays at the
    update's first ticket until `done(last)`, so a checkpoint (always between two updates) never
    holds part of an update, and a rollback drops the tickets held for it (they are issued again)."""

    def __init__(self, watermark: int = 0, per_update: int = 1):
        self.watermark = watermark
        self.buffer: dict[int, Item] = {}
        self.per_update = per_update

    def offer(self, item: Item) -> str:
        """'replay' (below the watermark), 'duplicate' (already buffered) or 'buffered'."""
        if item.index < self.watermark:
            return "replay"
        if item.index in self.buffer:  # two copies of the same work (a re-issue): either one will do
            return "duplicate"
        self.buffer[item.index] = item
        return "buffered"

    def next_ready(self) -> Item | None:
        return self.buffer.pop(self.watermark, None)

    def next_update(self, end: int) -> list[Item] | None:
        """Every ticket of the update at the watermark (the last one may end at the run's `end`),
        once all are buffered; None until then."""
        stop = min((self.watermark // self.per_update + 1) * self.per_update, max(end, self.watermark + 1))
        if any(i not in self.buffer for i in range(self.watermark, stop)):
            return None
        return [self.buffer.pop(i) for i in range(self.watermark, stop)]

    def done(self, index: int) -> None:
        assert index >= self.watermark, (index, self.watermark)
        self.watermark = index + 1

    def follow_leader(self, watermark: int) -> None:
        """A follower rank takes its leader's watermark (it gets the leader's tickets, in order)."""
        self.watermark = watermark

    def reset(self, watermark: int) -> list[Item]:
        out, self.buffer = list(self.buffer.values()), {}
        self.watermark = watermark
        return out


class SinkSeen:
    """The tickets a stateless sink node has consumed (seeded by the controller after a restart)."""

    def __init__(self, low: int = 0, consumed=()):
        self.seen = IndexSet(low, consumed)

    def first_time(self, index: int) -> bool:
        return self.seen.add(index)

    def reset(self, low: int, consumed) -> None:
        self.seen = IndexSet(low, consumed)


class OutputCache:
    """A stateful transform's outputs by ticket index, kept until every sink has the ticket, so a
    re-issued ticket below the watermark gets the same output again (the state is not touched)."""

    def __init__(self):
        self.outputs: dict[int, Any] = {}

    def put(self, index: int, result: Any) -> None:
        self.outputs[index] = result

    def get(self, index: int) -> Any:
        return self.outputs.get(index)

    def forget_below(self, index: int) -> None:
        for i in [i for i in self.outputs if i < index]:
            del self.outputs[i]

    def clear(self) -> None:
        self.outputs = {}


@dataclass
class Policies:
    """The input policies of one node's shape (None where the shape has no use for one)."""

    fence: Fence
    gate: VersionGate
    ordered: Ordered | None = None
    cache: OutputCache | None = None
    joins: JoinBuffer | None = None
    seen: SinkSeen | None = None

    @classmethod
    def of(cls, shape, epoch: int = 0, watermark: int = 0, consumed=(), per_update: int = 1) -> "Policies":
        """`shape`: the node's `Shape` (shape.py); the rest from the process spec (where to resume).
        `per_update`: tickets per training update (`schedule.tickets_per_update`), which a stateful
        sink (a trainer) takes together."""
        return cls(fence=Fence(epoch), gate=VersionGate(),
                   ordered=Ordered(watermark, per_update if shape.sink else 1) if shape.stateful else None,
                   cache=OutputCache() if shape.stateful and not shape.sink else None,
                   joins=JoinBuffer(shape.inputs) if shape.join else None,
                   seen=SinkSeen(watermark, consumed) if shape.sink and not shape.stateful else None)
