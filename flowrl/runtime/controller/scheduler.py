"""The scheduler: issues work tickets under a staleness bound and tracks them until every sink has them.

Ticket `i` feeds training update `u(i) = i // G`, where `G = tickets_per_update` (1 with
`schedule.ticket: batch`; `batch_size` with `ticket: group`, one prompt group per ticket). With
`max_staleness = k` it is issued only once the trainer holds version `>= u(i) - k`, and rollouts
must generate it with weights of at least that version. Stateful nodes take tickets in index order
(a trainer the `G` tickets of one update together), so update `u` runs at version `u` and every
sample it uses is at most `k` versions old. At most `(k + 1) x G` tickets are in flight.

A ticket is complete when every sink node consumed it (or received its drop marker). Until then it
is open: `reissue_open` sends it out again with `attempt + 1` when a node that held it died,
`timed_out` when it took longer than `ticket_timeout_s`; past `max_attempts` the run fails with
`TicketExhausted` naming it. `rollback(step)` undoes every stateful sink's consumption from `step`
on (their state was restored to that checkpoint) and issues those tickets again.

A ticket whose drop marker asks to be replaced (`flowrl.Drop(..., replace=True)`: a DAPO filter
holds its groups for a later batch) extends the run by one ticket once it completes, so the run
still makes `steps` training updates; at most `max_replaced` tickets are added per run
(`Replacements`, replacements.py, owns that count).

Memory and per-call cost are O(open tickets): consumption per sink is an `IndexSet` (a watermark
plus the few above it), and complete tickets are forgotten. Pure bookkeeping: no sockets, no
processes; the controller drives it and every event goes to the ledger.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

from flowrl.errors import FlowrlError
from flowrl.runtime.controller.replacements import Replacements
from flowrl.runtime.protocol.indexset import IndexSet
from flowrl.runtime.protocol.ledger import (DuplicateDropped, Ledger, RolledBack, TicketCompleted, TicketConsumed,
                                            TicketDropped, TicketIssued, TicketReissued, net_consumption)
from flowrl.node import Ticket, is_replace


class TicketExhausted(FlowrlError):
    """A ticket was issued `max_attempts` times and still not consumed by every sink."""

    def __init__(self, batch_id: str, index: int, attempts: int, reason: str):
        self.batch_id, self.index, self.attempts, self.reason = batch_id, index, attempts, reason
        super().__init__(f"ticket {batch_id} (index {index}) was issued {attempts} times and is still not "
                         f"consumed by every sink (last re-issue: {reason})")


@dataclass(frozen=True)
class TicketLimits:
    """The run's fixed schedule: `steps` updates (before replacements), `batch_size` per ticket,
    staleness bound `max_staleness`, and when a ticket is re-issued or gives up."""

    steps: int
    batch_size: int
    max_staleness: int
    tickets_per_update: int
    ticket_timeout_s: float
    max_attempts: int


@dataclass
class TicketState:
    attempt: int = 0
    issued_at: float = 0.0
    reason: str = ""


class Scheduler:
    """Tickets, versions and per-sink consumption for one run."""

    def __init__(self, *, steps: int, batch_size: int, max_staleness: int, sinks: list[str],
                 ticket_timeout_s: float, ledger: Ledger, run_id: str = "t", stateful_sinks=(),
                 max_attempts: int = 10, epoch: Callable[[], int] = lambda: 0, max_replaced: int | None = None,
                 tickets_per_update: int = 1):
        self.limits = TicketLimits(steps=steps, batch_size=batch_size, max_staleness=max_staleness,
                                   tickets_per_update=tickets_per_update,
                                   ticket_timeout_s=ticket_timeout_s, max_attempts=max_attempts)
        self.sinks = list(sinks)
        self.stateful_sinks = set(stateful_sinks)
        self.ledger = ledger
        self.run_id = run_id
        self._epoch = epoch  # the recovery epoch is the recovery book's: asked, never kept here
        self.next_index = 0
        self.version = 0  # trainer's policy version (published, or completed count without a trainer)
        self.consumed_by = {s: IndexSet() for s in self.sinks}
        self.complete = IndexSet()
        self.open: dict[int, TicketState] = {}
        self.attempts: dict[int, int] = {}  # last attempt of indices issued before a rollback
        self.replacements = Replacements(limit=10 * steps if max_replaced is None else max_replaced,
                                         ledger=ledger, batch_id=self.batch_id)
        self.issued_end = 0  # one past the highest index ever issued (the end may shrink in a rollback)

    # ids ------------------------------------------------------------------------------------
    def batch_id(self, index: int) -> str:
        return f"{self.run_id}-{index:06d}"

    @staticmethod
    def index_of(batch_id: str) -> int:
        return int(batch_id.rsplit("-", 1)[1])

    @classmethod
    def _index_in(cls, batch_id) -> int | None:
        """The ticket index of a ledger row's batch_id; None for run-level rows ("-")."""
        if not isinstance(batch_id, str) or "-" not in batch_id:
            return None
        try:
            return cls.index_of(batch_id)
        except ValueError:
            return None

    def open_index(self, batch_id) -> int | None:
        """The index of the open ticket `batch_id` names; None for any other id (another run's too)."""
        index = self._index_in(batch_id)
        return index if index in self.open and self.batch_id(index) == batch_id else None

    # state ----------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Tickets the run issues: `steps` plus one per replaced ticket."""
        return self.base_steps + self.replacements.added

    @property
    def base_steps(self) -> int:
        return self.limits.steps

    @base_steps.setter
    def base_steps(self, steps: int) -> None:  # tests move the run's end by hand
        self.limits = dataclasses.replace(self.limits, steps=steps)

    @property
    def max_replaced(self) -> int:
        return self.replacements.limit

    @property
    def replace_refused(self) -> int:
        """Replace drops past `max_replaced` (plain drops: the run makes fewer updates)."""
        return self.replacements.refused

    @property
    def epoch(self) -> int:
        """The current recovery epoch (tickets are stamped with it), as its owner says."""
        return self._epoch()

    @property
    def completed(self) -> int:
        """Tickets consumed by every sink."""
        return self.complete.low + len(self.complete.extras)

    @property
    def complete_below(self) -> int:
        return self.complete.low

    @property
    def done(self) -> bool:
        return self.complete.low >= self.steps

    @property
    def in_flight(self) -> list[str]:
        return [self.batch_id(i) for i in sorted(self.open)]

    def min_version(self, index: int) -> int:
        """The oldest weights ticket `index` may be generated with: its update's version minus `k`."""
        return max(0, index // self.limits.tickets_per_update - self.limits.max_staleness)

    def _ticket(self, index: int) -> Ticket:
        return Ticket(batch_id=self.batch_id(index), index=index, attempt=self.open[index].attempt,
                      min_policy_version=self.min_version(index), size=self.limits.batch_size,
                      epoch=self.epoch)

    # issuing --------------------------------------------------------------------------------
    def issuable(self) -> list[Ticket]:
        """Tickets that may go out now (and are recorded as issued)."""
        out = []
        k, per = self.limits.max_staleness, self.limits.tickets_per_update
        while self.next_index < self.steps and self.version >= self.next_index // per - k:
            i = self.next_index
            self.next_index += 1
            self.issued_end = max(self.issued_end, self.next_index)
            if i in self.complete:
                continue
            previous = self.attempts.pop(i, None)
            state = TicketState(attempt=0 if previous is None else previous + 1, issued_at=time.monotonic())
            self.open[i] = state
            if previous is None:
                self.ledger.record(TicketIssued(batch_id=self.batch_id(i), index=i, min_version=self.min_version(i)))
            else:
                state.reason = "rollback"
                self.ledger.record(TicketReissued(batch_id=self.batch_id(i), attempt=state.attempt, reason="rollback"))
            out.append(self._ticket(i))
        return out

    def _again(self, i: int, reason: str, now: float) -> Ticket:
        state = self.open[i]
        if state.attempt + 1 >= self.limits.max_attempts:
            raise TicketExhausted(self.batch_id(i), i, state.attempt + 1, reason)
        state.attempt += 1
        state.issued_at = now
        state.reason = reason
        self.ledger.record(TicketReissued(batch_id=self.batch_id(i), attempt=state.attempt, reason=reason))
        return self._ticket(i)

    def reissue_open(self, reason: str) -> list[Ticket]:
        """Every open ticket again, attempt + 1 (a node that may have held it died)."""
        now = time.monotonic()
        return [self._again(i, reason, now) for i in sorted(self.open)]

    def timed_out(self, now: float | None = None) -> list[Ticket]:
        """Open tickets older than the timeout, re-issued (a lost message, a stuck node)."""
        now = time.monotonic() if now is None else now
        return [self._again(i, "timeout", now) for i in sorted(self.open)
                if now - self.open[i].issued_at > self.limits.ticket_timeout_s]

    def restart_clock(self) -> None:
        """Open tickets count their timeout from now (after a pause in which nothing could move)."""
        now = time.monotonic()
        for state in self.open.values():
            state.issued_at = now

    # consumption ----------------------------------------------------------------------------
    def consumed(self, sink: str, index: int, attempt: int = 0, *, dropped_by: str | None = None, **extra) -> bool:
        """Sink node `sink` consumed ticket `index` (or its drop marker). Returns True when that
        completes the ticket; a second consumption by the same sink is a recorded duplicate."""
        bid = self.batch_id(index)
        seen = self.consumed_by.get(sink)
        if seen is None or not 0 <= index < max(self.steps, self.issued_end) or not seen.add(index):
            self.ledger.record(DuplicateDropped(batch_id=bid, attempt=attempt, node=sink, why="already consumed by this sink"))
            return False
        if dropped_by is not None:
            replace = is_replace(dropped_by)
            self.ledger.record(TicketDropped(batch_id=bid, attempt=attempt, node=sink, by=dropped_by, replace=replace))
            if replace:
                self.replacements.mark(index, sink)
        else:
            self.ledger.record(TicketConsumed(batch_id=bid, attempt=attempt, node=sink, **extra))
        if all(index in s for s in self.consumed_by.values()):
            self.complete.add(index)
            self.open.pop(index, None)
            self.ledger.record(TicketCompleted(batch_id=bid, attempt=attempt))
            self.replacements.completed(index, attempt, self.base_steps)
            for i in [i for i in self.attempts if i < self.complete.low]:
                del self.attempts[i]
            return True
        return False

    def consumed_above(self, sink: str, n: int) -> list[int]:
        """Tickets >= n that sink node `sink` already has (to tell a restarted sink)."""
        return self.consumed_by[sink].above(n)

    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

    # recovery -------------------------------------------------------------------------------
    def rollback(self, step: int, version: int, reason: str) -> None:
        """Every stateful node was restored to checkpoint `step` (in the epoch the book just
        began): stateful sinks lose what they consumed from `step` on, and every ticket from
        `step` on is issued again."""
        for sink in self.stateful_sinks:
            for i in self.consumed_by[sink].truncate(step):
                self.ledger.record(RolledBack(batch_id=self.batch_id(i), node=sink, reason=reason))
        self.replacements.rollback(step, self.stateful_sinks, reason)
        self.complete.truncate(step)
        for i, state in self.open.items():
            self.attempts[i] = max(self.attempts.get(i, 0), state.attempt)
        for i in range(step, self.next_index):
            self.attempts.setdefault(i, 0)
        self.open = {}
        self.next_index = min(self.next_index, step)
        self.version = version

    def state_dict(self, step: int) -> dict:
        """What the checkpoint at `step` needs beyond the node states: small. Tickets below `step`
        are complete: the ones replaced there count from now on as a number."""
        return {"version": self.version, "replaced_below": self.replacements.commit(step),
                "stateless_consumed": {s: self.consumed_by[s].above(self.complete.low)
                                       for s in self.sinks if s not in self.stateful_sinks}}

    def resume(self, step: int, version: int, ledger_rows: list[dict], replaced_below: int = 0) -> None:
        """Continue a run from its checkpoint at `step`: tickets below it are complete; what
        stateless sinks consumed from `step` on stays consumed; stateful sinks' is rolled back."""
        self.replacements.resume(replaced_below)
        self.issued_end = step
        self.complete = IndexSet(step)
        for s in self.sinks:
            self.consumed_by[s] = IndexSet(step)
        undo: dict[int, int] = {}  # replacements past the checkpoint: decided again, so undone
        for row in ledger_rows:
            event, node, i = row.get("event"), row.get("node"), self._index_in(row.get("batch_id"))
            if i is None or i < step:
                continue
            if event == "dropped" and row.get("replace") and node in self.consumed_by \
                    and node not in self.stateful_sinks:
                self.replacements.mark(i, node)
            if event in ("replaced", "replace_undone"):
                undo[i] = undo.get(i, 0) + (1 if event == "replaced" else -1)
            if event in ("issued", "reissued"):
                self.attempts[i] = max(self.attempts.get(i, 0), row.get("attempt", 0))
        self.replacements.undone_on_resume(i for i, n in undo.items() if n > 0)
        held = sorted((node, i) for (bid, node), n in net_consumption(ledger_rows).net.items()
                      if n > 0 and node in self.consumed_by and (i := self._index_in(bid)) is not None and i >= step)
        for node, i in held:
            if node in self.stateful_sinks:
                self.ledger.record(RolledBack(batch_id=self.batch_id(i), node=node, reason="resume"))
            else:
                self.consumed_by[node].add(i)
        i = step
        while i < self.steps:  # a replaced ticket adds one to `steps`
            if all(i in s for s in self.consumed_by.values()):
                self.complete.add(i)
                self.replacements.completed(i, 0, self.base_steps)
            i += 1
        self.next_index = step
        self.version = version
