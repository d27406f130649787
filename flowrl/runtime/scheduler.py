"""The scheduler: issues work tickets under a staleness bound and keeps the ledger.

Ticket `i` feeds training update `i`. With `max_staleness = k` it is issued only once the trainer
holds version `>= i - k`, and rollouts must generate it with weights of at least that version. The
sink consumes tickets in index order, so update `i` runs at version `i` and every sample it uses
is at most `k` versions old. At most `k + 1` tickets are in flight.

Every ticket stays in the ledger until a sink reports it consumed; when a node dies the controller
calls `reissue_in_flight` and the same work goes out again with `attempt + 1` (sinks and joins drop
duplicates by `batch_id`). Each event is appended to `RUN_DIR/ledger.jsonl`.

Pure bookkeeping: no sockets, no processes; the controller drives it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from flowrl.runtime.node import Ticket


@dataclass
class TicketState:
    index: int
    attempt: int = 0
    issued_at: float = 0.0
    consumed: bool = False
    consumers_done: set = field(default_factory=set)


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file (ledger.jsonl, metrics.jsonl); a last line cut by a kill is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


class Ledger:
    """Append-only record of ticket events (`RUN_DIR/ledger.jsonl`), flushed per event."""

    def __init__(self, path: Path | None):
        self.path = path
        self._f = open(path, "a", buffering=1) if path else None
        self.events: list[dict] = []

    def write(self, event: str, batch_id: str, attempt: int, **extra) -> None:
        row = {"batch_id": batch_id, "attempt": attempt, "event": event, "t": round(time.time(), 6), **extra}
        self.events.append(row)
        if self._f:
            self._f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


class Scheduler:
    """Tickets, versions and the ledger for one run."""

    def __init__(self, *, steps: int, batch_size: int, max_staleness: int, sinks: list[str],
                 ticket_timeout_s: float, ledger: Ledger, run_id: str = "t", start_index: int = 0,
                 version: int = 0):
        self.steps, self.batch_size, self.k = steps, batch_size, max_staleness
        self.sinks = set(sinks)
        self.ticket_timeout_s = ticket_timeout_s
        self.ledger = ledger
        self.run_id = run_id
        self.next_index = start_index
        self.version = version  # trainer's policy version (published, or consumed count)
        self.tickets: dict[str, TicketState] = {}
        self.consumed_count = start_index

    # ids ------------------------------------------------------------------------------------
    def batch_id(self, index: int) -> str:
        return f"{self.run_id}-{index:06d}"

    def index_of(self, batch_id: str) -> int:
        return int(batch_id.rsplit("-", 1)[1])

    # issuing --------------------------------------------------------------------------------
    @property
    def in_flight(self) -> list[str]:
        return [b for b, s in self.tickets.items() if not s.consumed]

    @property
    def done(self) -> bool:
        return self.consumed_count >= self.steps

    def _ticket(self, batch_id: str, state: TicketState) -> Ticket:
        return Ticket(batch_id=batch_id, index=state.index, attempt=state.attempt,
                      min_policy_version=max(0, state.index - self.k), size=self.batch_size)

    def issuable(self) -> list[Ticket]:
        """Tickets that may go out now (and are recorded as issued)."""
        out = []
        while self.next_index < self.steps and self.version >= self.next_index - self.k:
            bid = self.batch_id(self.next_index)
            state = TicketState(index=self.next_index, issued_at=time.monotonic())
            self.tickets[bid] = state
            self.ledger.write("issued", bid, 0, index=state.index, min_version=max(0, state.index - self.k))
            out.append(self._ticket(bid, state))
            self.next_index += 1
        return out

    def reissue_in_flight(self, reason: str) -> list[Ticket]:
        """Every unconsumed ticket again, attempt + 1 (a node that held it died)."""
        out = []
        for bid in self.in_flight:
            state = self.tickets[bid]
            state.attempt += 1
            state.issued_at = time.monotonic()
            self.ledger.write("reissued", bid, state.attempt, reason=reason)
            out.append(self._ticket(bid, state))
        return out

    def timed_out(self, now: float | None = None) -> list[Ticket]:
        """Tickets in flight longer than the timeout, re-issued (a lost message, a stuck node)."""
        now = time.monotonic() if now is None else now
        out = []
        for bid in self.in_flight:
            state = self.tickets[bid]
            if now - state.issued_at > self.ticket_timeout_s:
                state.attempt += 1
                state.issued_at = now
                self.ledger.write("reissued", bid, state.attempt, reason="timeout")
                out.append(self._ticket(bid, state))
        return out

    # consumption ----------------------------------------------------------------------------
    def consumed(self, sink: str, batch_id: str, attempt: int, **extra) -> bool:
        """A sink consumed a ticket. Returns True when that completes the ticket."""
        state = self.tickets.get(batch_id)
        if state is None or state.consumed or sink in state.consumers_done:
            self.ledger.write("duplicate_dropped", batch_id, attempt, node=sink)
            return False
        state.consumers_done.add(sink)
        if state.consumers_done < self.sinks:
            return False
        state.consumed = True
        self.consumed_count += 1
        self.ledger.write("consumed", batch_id, attempt, node=sink, **extra)
        return True

    def rolled_back(self, batch_ids: list[str], reason: str) -> None:
        """A sink lost consumed tickets (restored from an older checkpoint): they go out again."""
        for bid in batch_ids:
            state = self.tickets.get(bid)
            if state is None or not state.consumed:
                continue
            state.consumed = False
            state.consumers_done.clear()
            self.consumed_count -= 1
            self.ledger.write("rolled_back", bid, state.attempt, reason=reason)

    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

    # checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"next_index": self.next_index, "version": self.version, "consumed_count": self.consumed_count,
                "tickets": {b: {"index": s.index, "attempt": s.attempt, "consumed": s.consumed}
                            for b, s in self.tickets.items()}}

    def load_state_dict(self, state: dict, applied: set[str] | None = None, version: int | None = None) -> None:
        """Restore; tickets the sinks' checkpoint did not apply become in flight again.
        `version`: the trainer's version as its checkpoint recorded it (it wins)."""
        self.next_index = state["next_index"]
        self.version = state["version"] if version is None else version
        self.tickets = {}
        for bid, s in state["tickets"].items():
            consumed = s["consumed"] if applied is None else bid in applied
            self.tickets[bid] = TicketState(index=s["index"], attempt=s["attempt"], consumed=consumed,
                                            consumers_done=set(self.sinks) if consumed else set())
        for bid in applied or ():  # consumed after the snapshot was taken, before the sink saved
            if bid not in self.tickets:
                self.tickets[bid] = TicketState(index=self.index_of(bid), consumed=True, consumers_done=set(self.sinks))
        if self.tickets:
            self.next_index = max(self.next_index, max(s.index for s in self.tickets.values()) + 1)
        self.consumed_count = sum(1 for s in self.tickets.values() if s.consumed)
