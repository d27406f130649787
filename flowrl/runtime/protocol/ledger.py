"""The ledger: `RUN_DIR/ledger.jsonl`, one JSON object per ticket event, and the audit that reads it.

Events (field `event`), each with `batch_id`, `attempt` and `t`:

    issued        {index}                   the scheduler gave out a ticket
    reissued      {reason}                  the same work again, attempt + 1
    consumed      {node: SINK, ...}         sink node SINK consumed the ticket (one per ticket per sink)
    dropped       {node: SINK, by: NODE}    SINK received the ticket's drop marker (NODE dropped it)
    rolled_back   {node: SINK, reason}      undoes one consumed/dropped of SINK (its state was restored)
    duplicate_dropped {node, why}           a copy dropped at a node's input (not counted)
    checkpoint    {step, epoch}             a consistent checkpoint committed (batch_id "-")
    recovery      {epoch, step, reason}     every stateful node rolled back to checkpoint `step`
    node_down, resumed, weights, failed     what happened to processes, resume, weight digests
    replanned     {host, moved}             a lost host's processes moved: {process id: new host}

Exactly once: for every issued ticket and every sink node, consumed + dropped - rolled_back == 1.
Rows are written with one `write` each (a line survives a kill whole or not at all) and fsynced
when a checkpoint commits, so a committed checkpoint never refers to events the disk lost.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


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

    def write(self, event: str, batch_id: str, attempt: int = 0, **extra) -> None:
        self.rows += 1
        if self._f:
            row = {"batch_id": batch_id, "attempt": attempt, "event": event, "t": round(time.time(), 6), **extra}
            self._f.write(json.dumps(row) + "\n")

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
    issued = {r["batch_id"] for r in rows if r.get("event") == "issued"}
    net: Counter = Counter()
    dropped = set()
    seen_sinks = set()
    for r in rows:
        event = r.get("event")
        key = (r.get("batch_id"), r.get("node"))
        if event in ("consumed", "dropped"):
            net[key] += 1
            seen_sinks.add(r.get("node"))
            if event == "dropped":
                dropped.add(key)
        elif event == "rolled_back" and r.get("node") is not None:
            net[key] -= 1
    sinks = set(sinks) if sinks is not None else seen_sinks
    lost = sorted((b, s) for b in issued for s in sinks if net[(b, s)] < 1)
    duplicated = sorted((b, s) for b in issued for s in sinks if net[(b, s)] > 1)
    return Audit(issued, sinks, net, lost, duplicated, dropped)
