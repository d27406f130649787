"""The ledger: `RUN_DIR/ledger.jsonl`, one JSON object per ticket event, and the audit that reads it.

Each event is a dataclass below, written with `Ledger.record(event)` as one JSON line
`{"batch_id", "attempt", "event": NAME, "t", ...its fields}` (`read_ledger` reads them back as
dicts; tools and tests match on `row["event"]`). Run-level events have `batch_id` "-":

    issued        TicketIssued {index, min_version}       the scheduler gave out a ticket
    reissued      TicketReissued {reason}                 the same work again, attempt + 1
    consumed      TicketConsumed {node: SINK, ...}        sink node SINK consumed the ticket
    dropped       TicketDropped {node: SINK, by, replace?} SINK received the ticket's drop marker
    rolled_back   RolledBack {node: SINK, reason}         undoes one consumed/dropped of SINK
    duplicate_dropped DuplicateDropped {node, why}        a copy dropped at a node's input (not counted)
    completed     TicketCompleted {}                      every sink has the ticket
    replaced      TicketReplaced {steps}                  a replace drop added a ticket: the run's end
    replace_refused ReplaceRefused {limit}                past schedule.max_replaced: not replaced
    replace_undone ReplaceUndone {reason}                 a rollback undid a replacement
    checkpoint    CheckpointCommitted {step, epoch}       a consistent checkpoint committed
    recovery      RecoveryStarted {epoch, step, reason}   every stateful node rolled back to `step`
    resumed       Resumed {step, epoch}                   a run continued from its checkpoint
    node_down     NodeDown {node, why}                    a process died (`attempt`: its incarnation)
    weights       WeightsHeld {node, version, digest}     a process holds weights `version`
    scaled        NodeScaled {node, replicas, was}        `flowrl scale` changed a node's replicas
    replanned     Replanned {host, moved}                 a lost host's processes moved: {id: new host}
    shard         ShardPlaced {proc, file, host, holder, fetched, sha256}  a checkpoint shard read or fetched
    plan          PlanChanged {revision, why, ...}        plan.json rewritten: {added, removed, moved}
    failed        RunFailure {why}                        the run failed (first line of the reason)

Exactly once (`net_consumption`): for every issued ticket and every sink node,
consumed + dropped - rolled_back == 1. Each row is one write to the file (a line survives a
kill whole or not at all) and fsynced when a checkpoint commits, so a committed checkpoint never
refers to events the disk lost.

    ledger.record(TicketIssued(batch_id="t-000003", index=3, min_version=1))
    audit_ledger(read_ledger(run_dir), sinks=["actor"]).exactly_once
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterable

OMIT_DEFAULT = {"omit_default": True}
"""Field metadata: the field is left out of the row when it holds its default (rows stay as short
as the runtime always wrote them)."""

_EVENTS: dict[str, type] = {}


def event(name: str):
    """Register a ledger event class under its row name `name` (the row's `event` field)."""

    def wrap(cls):
        cls = dataclass(frozen=True, kw_only=True)(cls)
        cls.event = name
        cls._layout = tuple((f.name, f.default if f.metadata.get("omit_default") else dataclasses.MISSING)
                            for f in dataclasses.fields(cls) if f.name not in ("batch_id", "attempt"))
        _EVENTS[name] = cls
        return cls

    return wrap


def ledger_events() -> dict[str, type]:
    """Every ledger event class by row name (the docstring table above is checked against this)."""
    return dict(_EVENTS)


@dataclass(frozen=True, kw_only=True)
class LedgerEvent:
    """One ledger row. `batch_id`: the ticket ("-" for run-level events); `attempt`: its issue."""

    event: ClassVar[str]
    _layout: ClassVar[tuple]
    batch_id: str
    attempt: int = 0

    def row(self, t: float) -> dict:
        """The JSON object written: batch_id, attempt, event, t, then the fields in order."""
        out = {"batch_id": self.batch_id, "attempt": self.attempt, "event": self.event, "t": t}
        for name, omit_when in self._layout:
            value = getattr(self, name)
            if value is not omit_when and value != omit_when:
                out[name] = value
        return out


@dataclass(frozen=True, kw_only=True)
class RunEvent(LedgerEvent):
    """An event of the run, not of one ticket: `batch_id` "-"."""

    batch_id: str = "-"


# tickets ------------------------------------------------------------------------------------------
@event("issued")
class TicketIssued(LedgerEvent):
    index: int
    min_version: int


@event("reissued")
class TicketReissued(LedgerEvent):
    reason: str


@event("consumed")
class TicketConsumed(LedgerEvent):
    node: str
    policy_version: int | None = field(default=None, metadata=OMIT_DEFAULT)
    staleness: int | None = field(default=None, metadata=OMIT_DEFAULT)


@event("dropped")
class TicketDropped(LedgerEvent):
    node: str
    by: str
    replace: bool = field(default=False, metadata=OMIT_DEFAULT)


@event("rolled_back")
class RolledBack(LedgerEvent):
    node: str
    reason: str


@event("duplicate_dropped")
class DuplicateDropped(LedgerEvent):
    node: str
    why: str


@event("completed")
class TicketCompleted(LedgerEvent):
    pass


@event("replaced")
class TicketReplaced(LedgerEvent):
    steps: int


@event("replace_refused")
class ReplaceRefused(LedgerEvent):
    limit: int


@event("replace_undone")
class ReplaceUndone(LedgerEvent):
    reason: str


# the run ------------------------------------------------------------------------------------------
@event("checkpoint")
class CheckpointCommitted(RunEvent):
    step: int
    epoch: int


@event("recovery")
class RecoveryStarted(RunEvent):
    epoch: int
    step: int
    reason: str


@event("resumed")
class Resumed(RunEvent):
    step: int
    epoch: int


@event("node_down")
class NodeDown(RunEvent):
    node: str
    why: str


@event("weights")
class WeightsHeld(RunEvent):
    node: str
    version: int
    digest: str | None


@event("scaled")
class NodeScaled(RunEvent):
    node: str
    replicas: int
    was: int


@event("replanned")
class Replanned(RunEvent):
    host: str
    moved: dict[str, str]


@event("shard")
class ShardPlaced(RunEvent):
    """A stateful process starts from its checkpoint shard on `host`: read there (`fetched` False)
    or copied from `holder` first (controller/shards.py)."""

    proc: str
    file: str
    host: str
    holder: str
    fetched: bool
    sha256: str


@event("plan")
class PlanChanged(RunEvent):
    """RUN_DIR/plan.json was rewritten (revision 1, 2, ...): processes added {id: host}, removed, moved."""

    revision: int
    why: str
    added: dict[str, str]
    removed: list[str]
    moved: dict[str, str]


@event("failed")
class RunFailure(RunEvent):
    why: str


# reading and writing --------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file (ledger.jsonl, metrics.jsonl); a last line cut by a kill is skipped."""
    from flowrl.segments import read_file

    return read_file(Path(path))


def read_ledger(run_dir: Path) -> list[dict]:
    """Every ledger row of a run, rotated segments (`ledger.N.jsonl.gz`) first, in order."""
    from flowrl.segments import read_all

    return read_all(Path(run_dir) / "ledger.jsonl")


class Ledger:
    """Append-only event log. Nothing is kept in memory: a long run's ledger lives on disk, and
    past `rotate_bytes` it is compressed into `ledger.N.jsonl.gz` segments at a checkpoint commit
    (about 10x smaller; `read_ledger` reads them all)."""

    def __init__(self, path: Path | None, rotate_bytes: int = 64 << 20):
        self.path = path
        self.rotate_bytes = rotate_bytes
        self._f = open(path, "a", buffering=1) if path else None  # line by line: a kill -9 loses no row
        self.rows = 0

    def record(self, ev: LedgerEvent) -> None:
        """Append one event (a `LedgerEvent` subclass above) as one line."""
        self.rows += 1
        if self._f:
            self._f.write(json.dumps(ev.row(round(time.time(), 6))) + "\n")

    def flush(self) -> None:
        if self._f:
            self._f.flush()

    def sync(self) -> None:
        """Flush and fsync: called when a checkpoint commits."""
        if self._f:
            self._f.flush()
            os.fsync(self._f.fileno())
            if self._f.tell() > self.rotate_bytes:
                self.rotate()

    def rotate(self) -> None:
        """Compress the current file into the next `ledger.N.jsonl.gz` and start a new one."""
        from flowrl.segments import rotate

        self._f.close()
        rotate(self.path)
        self._f = open(self.path, "a", buffering=1)

    def close(self) -> None:
        if self._f:
            self.sync()
            self._f.close()
            self._f = None


# exactly once -----------------------------------------------------------------------------------------
def sink_of(node) -> str | None:
    """The node a ledger row's `node` names: a process id `node/replica/rank` counts as its node."""
    return node.split("/")[0] if isinstance(node, str) else None


@dataclass
class Consumption:
    """Per (batch_id, sink node): how often it was consumed and dropped, and the net count."""

    net: Counter = field(default_factory=Counter)
    """consumed + dropped - rolled_back: exactly once is 1 for every issued ticket and sink."""
    consumed: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)

    @property
    def sinks(self) -> set[str]:
        """Every node that consumed or dropped a ticket."""
        return {sink for _, sink in (self.consumed + self.dropped)}


def net_consumption(rows: Iterable[dict]) -> Consumption:
    """The one exactly-once rule over ledger rows (the audit, a resumed scheduler and the chaos
    checker all count with it):

    - `consumed` and `dropped` add one to (batch_id, node), `rolled_back` takes one away;
    - a process id `node/replica/rank` counts as its node (replicas of a sink are that sink);
    - a `rolled_back` without `node` (older runtimes) undoes the ticket's latest consumption,
      whichever sink recorded it;
    - nothing else counts (`duplicate_dropped` is a copy refused at an input).

        net_consumption(rows).net[("t-000003", "actor")] == 1   # exactly once
    """
    out = Consumption()
    last_sink: dict[str, str | None] = {}
    for r in rows:
        ev = r.get("event")
        if ev == TicketConsumed.event or ev == TicketDropped.event:
            bid, sink = r.get("batch_id"), sink_of(r.get("node"))
            out.net[(bid, sink)] += 1
            (out.consumed if ev == TicketConsumed.event else out.dropped)[(bid, sink)] += 1
            last_sink[bid] = sink
        elif ev == RolledBack.event:
            bid = r.get("batch_id")
            out.net[(bid, sink_of(r.get("node")) or last_sink.get(bid))] -= 1
    return out


@dataclass
class Audit:
    """Ticket accounting from a ledger: per ticket and per sink node, net consumption."""

    issued: set[str]
    sinks: set[str]
    net: Counter
    lost: list[tuple[str, str]] = field(default_factory=list)
    duplicated: list[tuple[str, str]] = field(default_factory=list)

    @property
    def exactly_once(self) -> bool:
        return not self.lost and not self.duplicated and bool(self.issued)

    @property
    def consumed(self) -> Counter:
        """Net consumptions per ticket, summed over sinks (one sink: 1 per ticket)."""
        out: Counter = Counter()
        for (bid, _), n in self.net.items():
            out[bid] += n
        return out

    def dropped(self) -> set[str]:
        return {bid for (bid, sink), n in self.net.items() if n and (bid, sink) in self._dropped}

    _dropped: set = field(default_factory=set, repr=False)


def audit_ledger(rows: list[dict], sinks: list[str] | None = None) -> Audit:
    """Check every issued ticket was consumed (or dropped) exactly once by every sink node.
    `sinks`: the sink nodes (default: every node that consumed anything)."""
    issued = {r["batch_id"] for r in rows if r.get("event") == TicketIssued.event}
    counts = net_consumption(rows)
    sinks = set(sinks) if sinks is not None else counts.sinks
    lost = sorted((b, s) for b in issued for s in sinks if counts.net[(b, s)] < 1)
    duplicated = sorted((b, s) for b in issued for s in sinks if counts.net[(b, s)] > 1)
    return Audit(issued, sinks, counts.net, lost, duplicated, set(counts.dropped))
