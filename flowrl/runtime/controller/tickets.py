"""The ticket desk: sending tickets to sources, what a sink's `Consumed` report completes, and
telling nodes how far the run is.

Issuable and timed-out tickets go to the sources' rank-0 processes round-robin (held while a
recovery runs; kept for later when no source can take them; dropped when a rollback made them a
past epoch's); a ticket past its attempts fails the run naming where it was last seen busy. Every
so often (`controller.tickets.progress_interval_s`), and at once when the run's end moved, every
wired node hears `Progress`: which tickets are complete, where the run ends.

The desk is the one writer of the tickets waiting to go out, of where each open ticket was last
seen busy, of the source round-robin and of the progress watermark. The scheduler decides what is
issued and complete; the desk only carries it.

    desk = TicketDesk(scheduler, procs, sources=["rollout"], send=socket.send, fail=outcome.fail,
                      ledger=ledger, section=spec.controller.tickets)
    await desk.flush(held=False, epoch=0)      # each tick: issuable and timed-out tickets go out
    if desk.consumed("actor", msg): ...        # a sink's report completed a ticket: a step
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

from flowrl.graph.spec import TicketDeskSpec
from flowrl.runtime.controller.procs import Proc, ProcTable
from flowrl.runtime.controller.scheduler import Scheduler, TicketExhausted
from flowrl.runtime.protocol import messages as m

log = logging.getLogger("flowrl.controller")

Send = Callable[[Proc, object], Awaitable[bool]]
Fail = Callable[[Proc | None, str], None]


class TicketDesk:
    def __init__(self, scheduler: Scheduler, procs: ProcTable, *, sources, send: Send, fail: Fail, ledger,
                 section: TicketDeskSpec, clock: Callable[[], float] = time.monotonic):
        self.scheduler = scheduler
        self.procs = procs
        self.sources = list(sources)
        self.send = send
        self.fail = fail
        self.ledger = ledger
        self.section = section
        self.clock = clock
        self.pending: list = []  # tickets waiting for a source to take them
        self.stuck_at: dict[str, str] = {}  # batch id -> the process last seen busy with it
        self.refusals: dict[str, tuple[int, str, str]] = {}  # open batch id -> (attempt, process, why) refused first
        self.source_rr = 0
        self.last_progress, self.progress_sent, self.steps_sent = 0.0, -1, scheduler.steps

    # what nodes report ------------------------------------------------------------------------
    def seen_busy(self, batch_id: str, proc_id: str) -> None:
        """A heartbeat says `proc_id` is inside a call on `batch_id` (named if the ticket runs out)."""
        if self.scheduler.open_index(batch_id) is not None:
            self.stuck_at[batch_id] = proc_id

    def where(self, batch_id: str) -> str | None:
        return self.stuck_at.get(batch_id)

    def consumed(self, sink: str, msg: m.Consumed) -> bool:
        """A sink consumed a ticket (or its drop marker). True when that completed it: a step."""
        extra = {} if msg.dropped_by else {"policy_version": msg.policy_version, "staleness": msg.staleness}
        if self.scheduler.consumed(sink, msg.index, msg.attempt, dropped_by=msg.dropped_by, **extra):
            self.stuck_at.pop(msg.batch_id, None)
            self.refusals.pop(msg.batch_id, None)
            return True
        return False

    def dropped(self, proc_id: str, msg: m.Duplicate) -> None:
        """`proc_id` dropped a batch at its input. One of an open ticket that it refused at its
        boundary (`why` starts with INVALID: the batch lacks what the node `requires`) is said at
        once: the node's own log is where nobody looks. A forged batch is refused once and the real
        one still taken; a ticket refused again at a later attempt will be at every attempt (its
        producer makes the same batch), so the run fails then, naming why, rather than after
        `max_attempts` ticket timeouts that say only "exhausted"."""
        if not msg.why.startswith(m.INVALID) or self.scheduler.open_index(msg.batch_id) is None:
            return  # not one of the run's open tickets (a forgery): the node's counter holds it
        first = self.refusals.get(msg.batch_id)
        if first is None:
            self.refusals[msg.batch_id] = (msg.attempt, proc_id, msg.why)
            log.warning("%s refused %s (attempt %d): %s; the ticket is issued again after "
                        "schedule.ticket_timeout_s (%g s), and the run fails if that attempt is refused too",
                        proc_id, msg.batch_id, msg.attempt, msg.why, self.scheduler.limits.ticket_timeout_s)
        elif msg.attempt > first[0]:
            self.fail(None, f"{proc_id} refused {msg.batch_id} at attempts {first[0]} and {msg.attempt}: {msg.why}"
                            f"\n  its producer makes a batch without what the node declares it takes (`requires` "
                            f"of its class): make the producer emit it, or change the node's `requires`")

    # tickets ----------------------------------------------------------------------------------
    def drop_pending(self) -> None:
        """Tickets waiting to go out are void (a rollback, or a restart that re-issues them all)."""
        self.pending = []

    async def reissue(self, make, reason: str) -> None:
        """Queue what `make` re-issues; a ticket past its attempts fails the run naming where it was."""
        try:
            self.pending.extend(make(reason) if reason else make())
        except TicketExhausted as e:
            where = self.stuck_at.get(e.batch_id)
            errors = [f"{p.id}: {p.error.line().splitlines()[0]}" for p in self.procs if p.error]
            if e.batch_id in self.refusals:
                _, who, why = self.refusals[e.batch_id]
                errors.append(f"{who} refused it: {why}")
            self.fail(None, f"{e}\n  last seen inside a call at: {where or 'no node reported it'}"
                            f"\n  last node errors: {'; '.join(errors) or 'none'}"
                            f"\n  raise schedule.max_attempts or ticket_timeout_s if the work is just slow")

    async def flush(self, *, held: bool, epoch: int) -> None:
        """Send what may go out now to the sources; `held` (recovering, failed): nothing moves.
        A waiting ticket of another epoch than `epoch` is dropped."""
        if held:
            return
        self.pending.extend(self.scheduler.issuable())
        await self.reissue(self.scheduler.timed_out, "")
        keep = []
        for ticket in self.pending:
            if ticket.epoch != epoch:
                continue
            sent = False
            for node in self.sources:
                procs = [p for p in self.procs.of_node(node) if p.ready and p.wired and p.spec.rank == 0]
                if not procs:
                    continue
                p = procs[self.source_rr % len(procs)]
                self.source_rr += 1
                sent = await self.send(p, m.TicketMsg(batch_id=ticket.batch_id, index=ticket.index,
                                                      attempt=ticket.attempt, min_policy_version=ticket.min_policy_version,
                                                      size=ticket.size, epoch=ticket.epoch))
            if not sent:
                keep.append(ticket)
        self.pending = keep

    # progress ---------------------------------------------------------------------------------
    def end_moved(self) -> bool:
        """The run's end changed since nodes last heard it (a replaced ticket)."""
        return self.scheduler.steps != self.steps_sent

    async def progress(self) -> None:
        """Tell every wired node which tickets are complete (they forget cached outputs), at most
        once per progress interval, and at once when the end moved."""
        now = self.clock()
        low = self.scheduler.complete_below
        steps = self.scheduler.steps
        if (now - self.last_progress < self.section.progress_interval_s or low == self.progress_sent) \
                and steps == self.steps_sent:
            return
        self.last_progress, self.progress_sent, self.steps_sent = now, low, steps
        for p in self.procs:
            if p.wired:
                await self.send(p, m.Progress(complete_below=low, steps=steps))
