"""Tickets and progress (mixed into `Controller`): sending work to sources, and what a consumed
ticket sets off.

Issuable and timed-out tickets go to the sources' rank-0 processes round-robin (held while a
recovery runs; kept for later when no source can take them); a ticket past its attempts fails the
run naming where it was last seen. A sink's `Consumed` report advances the scheduler; each step
ends the metrics step, commits a checkpoint when one is ready and tells the nodes how far the run
is (`Progress`: which tickets are complete, where the run ends).
"""

from __future__ import annotations

import logging
import time

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.controller.procs import Proc
from flowrl.runtime.controller.scheduler import TicketExhausted

log = logging.getLogger("flowrl.controller")


class Tickets:
    """The controller's ticket half: issue, re-issue, consumption, steps, commits, progress."""

    def open_ids(self) -> set[str]:
        return {self.scheduler.batch_id(i) for i in self.scheduler.open}

    async def on_consumed(self, proc: Proc, msg: m.Consumed) -> None:
        self.ingest(proc, msg.metrics)
        sink = proc.spec.node
        if sink in self.stateful and msg.epoch != self.book.epoch:
            self.ledger.write("duplicate_dropped", msg.batch_id, msg.attempt, node=proc.id, why="older epoch")
            return
        extra = {} if msg.dropped_by else {"policy_version": msg.policy_version, "staleness": msg.staleness}
        if self.scheduler.consumed(sink, msg.index, msg.attempt, dropped_by=msg.dropped_by, **extra):
            self.stuck_at.pop(msg.batch_id, None)
            await self.on_step(msg)

    async def on_step(self, msg) -> None:
        sched = self.scheduler
        if not self.publishers:
            sched.set_version(sched.completed)
        if self.hub:
            from flowrl.metrics import write_status

            row = dict(step=sched.completed, policy_version=sched.version, extra={"staleness_max": msg.staleness})
            self.write_last_row()  # one deferred before (a rollback moved the end back): written now
            if sched.done:  # the last row waits for what nodes report on their way out (shutdown)
                self.last_row = {**row, "now": self.hub.clock()}
            else:
                self.hub.end_step(**row)
            write_status(self.run_dir, self.hub.live_state(), phase="running", graph=self.summary)
        self.maybe_commit()
        if self.scheduler.steps != self.steps_sent:  # a replaced ticket: nodes learn the new end first
            if self.summary is not None:
                self.summary["total_steps"] = self.scheduler.steps  # the live view's "step i/N"
            await self.progress()
        await self.flush_tickets()

    def write_last_row(self) -> None:
        """The deferred row of the last step, if any (a metrics file that cannot be written is logged,
        never a reason to leave node processes running)."""
        row, self.last_row = self.last_row, None
        if row is None or not self.hub:
            return
        try:
            self.hub.end_step(**row)
        except Exception as e:  # noqa: BLE001
            log.warning("the last metrics row (step %s) was not written: %s", row.get("step"), e)

    def maybe_commit(self) -> None:
        step = self.book.committable(self.scheduler.complete_below)
        if step is not None:
            self.book.commit(step, self.scheduler.state_dict(step))
            log.info("checkpoint %d committed", step)

    async def progress(self) -> None:
        """Tell every node which tickets are complete (they forget cached outputs), now and then."""
        now = time.monotonic()
        low = self.scheduler.complete_below
        steps = self.scheduler.steps
        if (now - self.last_progress < 0.25 or low == self.progress_sent) and steps == self.steps_sent:
            return
        self.last_progress, self.progress_sent, self.steps_sent = now, low, steps
        for p in self.procs:
            if p.wired:
                await self.send(p, m.Progress(complete_below=low, steps=steps))

    # tickets --------------------------------------------------------------------------------
    async def reissue(self, make, reason: str) -> None:
        try:
            self.pending_tickets.extend(make(reason) if reason else make())
        except TicketExhausted as e:
            where = self.stuck_at.get(e.batch_id)
            errors = [f"{p.id}: {p.error.line().splitlines()[0]}" for p in self.procs if p.error]
            self.fail(None, f"{e}\n  last seen inside a call at: {where or 'no node reported it'}"
                            f"\n  last node errors: {'; '.join(errors) or 'none'}"
                            f"\n  raise schedule.max_attempts or ticket_timeout_s if the work is just slow")

    async def flush_tickets(self) -> None:
        if self.recovering is not None or self.failure:
            return
        self.pending_tickets.extend(self.scheduler.issuable())
        await self.reissue(self.scheduler.timed_out, "")
        keep = []
        for ticket in self.pending_tickets:
            if ticket.epoch != self.book.epoch:
                continue
            sent = False
            for node in self.sources:
                procs = [p for p in self.procs.of_node(node) if p.ready and p.wired and p.spec.rank == 0]
                if not procs:
                    continue
                p = procs[self.source_rr % len(procs)]
                self.source_rr += 1
                sent = await self.send(p, m.TicketMsg(batch_id=ticket.batch_id, index=ticket.index, attempt=ticket.attempt,
                                                      min_policy_version=ticket.min_policy_version, size=ticket.size,
                                                      epoch=ticket.epoch))
            if not sent:
                keep.append(ticket)
        self.pending_tickets = keep
