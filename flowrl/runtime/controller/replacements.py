"""Replaced tickets: a ticket dropped with `replace=True` adds one ticket to the run's end.

A DAPO filter that holds a ticket's groups for a later batch drops the ticket with
`flowrl.Drop(..., replace=True)`; once every sink has that ticket, the run grows by one ticket so
it still makes `steps` training updates. The invariant this component owns:

    tickets added = replaced below the last commit + replaced above it <= limit

and each ticket adds at most one. Past the limit (`schedule.max_replaced`) a replace drop is a
plain drop, counted in `refused`. A rollback to `step` undoes every replacement from `step` on
(the ticket is open again and replaced once more if it drops again); a commit at `step` folds the
replacements below it into a number, since no rollback can reach them any more.

Pure bookkeeping for the scheduler, which decides when a ticket completes; every decision goes to
the ledger.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from flowrl.runtime.protocol.ledger import Ledger, ReplaceRefused, ReplaceUndone, TicketReplaced

log = logging.getLogger("flowrl.scheduler")


class Replacements:
    """Which tickets asked to be replaced, which were, and how many tickets that added."""

    def __init__(self, *, limit: int, ledger: Ledger, batch_id: Callable[[int], str]):
        self.limit = limit
        self.ledger = ledger
        self.batch_id = batch_id
        self.marks: dict[int, set[str]] = {}  # open tickets: the sinks that got a replace marker
        self.replaced: dict[int, set[str]] = {}  # completed and replaced above the last commit
        self.below = 0  # replaced below the last commit (no rollback reaches them)
        self.refused = 0  # replace drops past the limit

    @property
    def added(self) -> int:
        """Tickets the replacements added to the run's end."""
        return self.below + len(self.replaced)

    def mark(self, index: int, sink: str) -> None:
        """Sink `sink` received ticket `index`'s drop marker, asking for it to be replaced."""
        self.marks.setdefault(index, set()).add(sink)

    def completed(self, index: int, attempt: int, base_steps: int) -> bool:
        """Ticket `index` is complete: replaced (True) when a sink asked and the limit allows."""
        sinks = self.marks.pop(index, None)
        if not sinks:
            return False
        if self.added >= self.limit:
            self.refused += 1
            self.ledger.record(ReplaceRefused(batch_id=self.batch_id(index), attempt=attempt, limit=self.limit))
            log.warning("ticket %s was dropped with replace=True but schedule.max_replaced=%d tickets were added "
                        "already: it is not replaced, so the run makes one update fewer", self.batch_id(index),
                        self.limit)
            return False
        self.replaced[index] = sinks
        self.ledger.record(TicketReplaced(batch_id=self.batch_id(index), attempt=attempt,
                                          steps=base_steps + self.added))
        return True

    def rollback(self, step: int, restored: Iterable[str], reason: str) -> None:
        """Sinks `restored` went back to checkpoint `step`: replacements from `step` on are undone
        (replaced again if they drop again) and those sinks' markers from `step` on are gone."""
        restored = set(restored)
        for i in [i for i in self.replaced if i >= step]:
            self.marks[i] = self.replaced.pop(i)
            self.ledger.record(ReplaceUndone(batch_id=self.batch_id(i), reason=reason))
        for i in [i for i in self.marks if i >= step]:
            self.marks[i] -= restored
            if not self.marks[i]:
                del self.marks[i]

    def commit(self, step: int) -> int:
        """A checkpoint at `step` committed: replacements below it count as a number from now on.
        Returns that number (the checkpoint keeps it)."""
        for i in [i for i in self.replaced if i < step]:
            del self.replaced[i]
            self.below += 1
        return self.below

    def resume(self, below: int) -> None:
        """Start over from a checkpoint that counted `below` replacements; markers come back with
        `mark`, replacements past the checkpoint are decided again (`undone_on_resume`)."""
        self.below, self.replaced, self.marks = below, {}, {}

    def undone_on_resume(self, indices: Iterable[int]) -> None:
        """Replacements the ledger holds past the checkpoint: recorded as undone."""
        for i in sorted(indices):
            self.ledger.record(ReplaceUndone(batch_id=self.batch_id(i), reason="resume"))
