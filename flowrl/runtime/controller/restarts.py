"""Restarts and rollbacks (mixed into `Controller`): what happens after a process goes down.

The supervisor decides whether a process that went down is restarted (`Supervisor.on_down`);
this mixin carries the decision out. A dead rank takes its whole rank group down with it (a fresh
torch.distributed group); a process of a lost host is re-planned (`replan.py`). When the process
held state, a recovery epoch begins: the scheduler rolls back to the committed checkpoint, every
process gets an `Epoch` order, and the recovery ends when every process entered the epoch (then
weights sync again and the tickets go out again). A recovery has a deadline, and orders are sent
again to whoever has not entered.
"""

from __future__ import annotations

import logging
import time

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.controller.procs import Proc
from flowrl.runtime.controller.wiring import free_port

log = logging.getLogger("flowrl.controller")


class Restarts:
    """The controller's restart and recovery-epoch half."""

    async def on_down(self, proc: Proc, why: str) -> None:
        if self.hub:
            self.hub.set("node_up", 0, node=proc.spec.node, replica=str(proc.spec.replica), across="min")
        verdict = self.supervisor.on_down(proc, why)
        self.ledger.write("node_down", "-", proc.spec.incarnation, node=proc.id, why=why)
        if verdict != "restart":
            self.fail(proc, verdict)
            return
        if self.hub:
            self.hub.inc("restarts", node=proc.spec.node, replica=str(proc.spec.replica))
            self.hub.event("restart", node=proc.id, why=why)
        self.restart_rank_group(proc)
        if proc.spec.node in self.stateful:
            await self.begin_recovery(f"{proc.id} {why}")
        elif self.recovering is not None:
            self.recovering.update(p.id for p in self.rank_group(proc))
        else:  # weight sync goes on without it (and its rank group); it joins a new epoch once wired again
            await self.follow_members()

    def rank_group(self, proc: Proc) -> list[Proc]:
        return [p for p in self.procs.of_node(proc.spec.node) if p.spec.replica == proc.spec.replica]

    def restart_rank_group(self, proc: Proc) -> None:
        """A dead rank takes its whole group down: the survivors are stopped and every rank starts
        again together, in a fresh torch.distributed group (a new MASTER_PORT)."""
        group = self.rank_group(proc)
        if len(group) < 2:
            return
        port = str(free_port())
        for p in group:
            p.spec.env["MASTER_PORT"] = port
            if p is proc:
                continue
            if p.down_since is None and p.handle is not None:
                p.handle.stop(0.5)
                p.ready = p.wired = False
                p.down_since = time.monotonic()
                self.ledger.write("node_down", "-", p.spec.incarnation, node=p.id, why=f"its rank group lost {proc.id}")
            p.restart_at = proc.restart_at

    async def begin_recovery(self, reason: str) -> None:
        """Every stateful node rolls back to the committed checkpoint; the tickets after it replay."""
        epoch = self.book.begin_recovery()
        committed = self.book.committed
        step = committed["step"] if committed else 0
        version = committed["version"] if committed else 0
        self.scheduler.rollback(step, version, epoch, reason)
        self.ledger.write("recovery", "-", 0, epoch=epoch, step=step, reason=reason)
        log.warning("recovery epoch %d: every stateful node back to step %d (%s)", epoch, step, reason)
        self.pending_tickets = []
        self.sync_members, self.sync_identities = [], frozenset()
        self.recovering = {p.id for p in self.procs if not p.retired}  # removed replicas never enter it
        self.recovery_started = self.last_epoch_order = time.monotonic()
        for proc in self.procs:
            if proc.ready and proc.down_since is None and proc.restart_at is None:
                await self.send(proc, self.epoch_order(proc, epoch))

    def epoch_order(self, proc: Proc, epoch: int) -> m.Epoch:
        committed = self.book.committed
        if proc.spec.node in self.stateful:
            return m.Epoch(epoch=epoch, watermark=committed["step"] if committed else 0,
                           checkpoint=self.book.file_for(proc.id))
        if proc.spec.node in self.sinks:
            low = self.scheduler.complete_below
            return m.Epoch(epoch=epoch, watermark=low, consumed=self.scheduler.consumed_above(proc.spec.node, low))
        return m.Epoch(epoch=epoch, watermark=0)

    async def entered(self, proc: Proc) -> None:
        """`proc` is in the current epoch; when every process is, recovery is over."""
        if self.recovering is None:
            return
        self.recovering.discard(proc.id)
        await self.recovered_if_done()

    async def recovered_if_done(self) -> None:
        if not self.recovering:
            self.recovering = None
            self.scheduler.restart_clock()
            log.warning("recovery epoch %d complete", self.book.epoch)
            await self.new_sync_epoch()
            await self.flush_tickets()

    def restart(self, proc: Proc) -> None:
        if self.launcher.is_lost(proc.spec.host):  # its whole host left: its processes move (replan.py)
            from flowrl.runtime.controller.replan import move_off

            why = move_off(self, proc.spec.host)
            if why:
                self.fail(proc, why)
                return
        proc.spec.incarnation += 1
        self.prepare_start(proc)
        self.supervisor.launch(proc)
        if self.hub:
            self.hub.set("node_up", 0, node=proc.spec.node, replica=str(proc.spec.replica), across="min")

    async def watch_recovery(self) -> None:
        """A recovery has a deadline too: orders are sent again to whoever has not entered the
        epoch (a lost message, a process that was starting), and a recovery that does not finish
        within startup_timeout_s fails the run naming who is missing."""
        if self.recovering is None:
            return
        # a replica `flowrl scale` removed (and then forgot) is not waited for
        gone = self.recovering - {p.id for p in self.procs if not p.retired}
        if gone:
            self.recovering -= gone
            await self.recovered_if_done()
            if self.recovering is None:
                return
        now = time.monotonic()
        missing = [p for p in self.procs if p.id in self.recovering]
        if now - self.recovery_started > self.spec.supervision.startup_timeout_s:
            self.fail(None, f"recovery epoch {self.book.epoch} did not complete within "
                            f"{self.spec.supervision.startup_timeout_s:.0f} s (supervision.startup_timeout_s); "
                            f"still waiting for {', '.join(p.id for p in missing)}")
            return
        if now - self.last_epoch_order > 2.0:
            self.last_epoch_order = now
            for proc in missing:
                if proc.wired and proc.down_since is None and proc.restart_at is None:
                    await self.send(proc, self.epoch_order(proc, self.book.epoch))
