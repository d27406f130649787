"""The controller: spawns node processes, runs the scheduler, supervises, checkpoints, recovers.

It never carries batch payloads — data flows node to node over the edges' channels; the controller
only handles the control plane. Each piece of state has one owner, a component that is its only
writer; components are handed what they need and talk through method calls:

    Supervisor     launch, watch (exit, READY, heartbeats, process timeout), restart budget (supervisor.py)
    Scheduler      tickets under the staleness bound, per-sink consumption, re-issue, max attempts (scheduler.py)
    RecoveryBook   consistent checkpoints, the recovery epoch, rollback target, pruning (recovery.py)
    Recovery       a recovery epoch in progress: who has yet to enter it, its deadline (recovery.py)
    TicketDesk     tickets going out, where they were seen busy, the progress watermark (tickets.py)
    SyncGroup      weight-sync epochs, members and Sync orders (weightorders.py)
    Wiring         process specs, start points, bound addresses, routes, the plan (wiring.py)
    Restarts       a process down: restart, rank groups, re-planning a lost host (restarts.py, replan.py)
    Retirement     replicas `flowrl scale` removed, until they are gone (scaling.py)
    RunReport      metrics rows and the live view (report.py)
    ControlSocket  the control ROUTER, the run's secret, control.json (control.py)

This module wires them, dispatches each control message to its handler (one per message type)
and runs the loop and the run's lifetime. Tuning lives in the graph: `controller:` (loop tick,
final checkpoint wait, and the sections of the ticket desk, weight sync and recovery) and
`supervision:`.

Recovery (docs/recovery.md): a stateless node that dies is restarted and the open tickets are
issued again. A stateful node that dies opens a new recovery epoch: issuing pauses, every stateful
node loads the last committed checkpoint, every node drops batches of older epochs, the weights
are re-broadcast from the restored trainer, and the tickets from the checkpoint's step on go out
again.
"""

from __future__ import annotations

import logging
import signal
import time
from functools import partial
from pathlib import Path

import anyio

from flowrl.runtime.controller.control import ControlSocket
from flowrl.runtime.controller.outcome import Outcome
from flowrl.runtime.controller.procs import NodeFailure, Proc, ProcTable
from flowrl.runtime.controller.recovery import Recovery, RecoveryBook
from flowrl.runtime.controller.replan import move_off
from flowrl.runtime.controller.report import IDLE_S, QUIET_S, RunReport
from flowrl.runtime.controller.restarts import Restarts
from flowrl.runtime.controller.roles import Roles, node_shapes
from flowrl.runtime.controller.scaling import Retirement, ScaleError, scale
from flowrl.runtime.controller.scheduler import Scheduler
from flowrl.runtime.controller.shards import prune_shards
from flowrl.runtime.controller.supervisor import Supervisor
from flowrl.runtime.controller.tickets import TicketDesk
from flowrl.runtime.controller.weightorders import SyncGroup
from flowrl.runtime.controller.wiring import RunFacts, Wiring, free_port, make_sockdir
from flowrl.runtime.launch.launcher import Launcher
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.addresses import Network
from flowrl.runtime.protocol.errors import RunFailed
from flowrl.runtime.protocol.ledger import DuplicateDropped, Ledger, Resumed, WeightsHeld

__all__ = ["Controller", "Outcome", "RunFailed", "node_shapes", "make_sockdir", "free_port"]

log = logging.getLogger("flowrl.controller")


class Controller:
    def __init__(self, spec, plan, run_dir: Path, launcher: Launcher, *, faults: list[str] = (),
                 resume: dict | None = None, hub=None, on_tick=None, summary: dict | None = None,
                 inventory: str | None = None):
        from flowrl.graph import node_classes
        self.spec = spec
        classes = node_classes(spec)
        self.roles = roles = Roles.of(spec, classes)
        # where every process runs decides its links (addresses.py); a host the launcher cannot
        # place fails the run here, before anything is made
        net = Network(spec, classes, "", launcher.controller_address(), curve=spec.launcher.curve)
        for entry in plan.entries:
            net.place(f"{entry.node}/{entry.replica}/{entry.rank}", launcher.host_address(entry.host))
        self.control = control = ControlSocket(net, run_dir)
        for sub in ("logs", "procs", "checkpoints"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        sched, sup, ctl = spec.schedule, spec.supervision, spec.controller
        self.ledger = ledger = Ledger(run_dir / "ledger.jsonl")
        self.procs = procs = ProcTable()
        supervisor = Supervisor(launcher, run_dir, sup, {n: node.on_failure for n, node in spec.nodes.items()})
        self.outcome = outcome = Outcome(supervisor, ledger)
        self.report = report = RunReport(hub, run_dir, summary, on_tick)
        members = [f"{e.node}/{e.replica}/{e.rank}" for e in plan.entries if e.node in roles.stateful]
        self.book = book = RecoveryBook(run_dir, members, keep=sched.keep_checkpoints, ledger=ledger,
                                        publishers=roles.publishers)  # every rank saves its own state
        self.scheduler = scheduler = Scheduler(
            steps=sched.total_tickets, batch_size=sched.ticket_size, tickets_per_update=sched.tickets_per_update,
            max_staleness=sched.max_staleness, sinks=list(roles.sinks),
            stateful_sinks=roles.stateful_sinks, ticket_timeout_s=sched.ticket_timeout_s,
            max_attempts=sched.max_attempts, max_replaced=sched.max_replaced, ledger=ledger,
            epoch=lambda: book.epoch)  # the book holds the epoch; the scheduler asks
        send = control.send
        self.wiring = wiring = Wiring(spec, plan, classes, roles, net,
                                      RunFacts(run_dir, control.secret, tuple(spec.faults) + tuple(faults), inventory),
                                      launcher=launcher, procs=procs, send=send, book=book, scheduler=scheduler,
                                      ledger=ledger)  # it keeps plan.json current (scale, re-plan)
        self.desk = TicketDesk(scheduler, procs, sources=roles.sources, send=send, fail=outcome.fail, ledger=ledger,
                               section=ctl.tickets)
        self.sync = sync = SyncGroup(procs, roles, send=send, fail=outcome.fail, ledger=ledger,
                                     section=ctl.weight_sync, deadline_s=sup.deadline_s)
        self.recovery = Recovery(book, scheduler, procs, roles, send=send, ledger=ledger, section=ctl.recovery,
                                 startup_timeout_s=sup.startup_timeout_s)
        self.restarts = Restarts(supervisor, launcher, procs, wiring=wiring, report=report, ledger=ledger,
                                 fail=outcome.fail, replan=partial(move_off, launcher=launcher, procs=procs, spec=spec,
                                                                   classes=classes, net=net, ledger=ledger,
                                                                   report=report, relink=wiring.relink_ranks,
                                                                   planfile=wiring.planfile))
        self.retirement = Retirement(procs, sync, report, stop_timeout_s=sup.stop_timeout_s)
        wiring.build_procs()
        if resume:
            self.resume_from(resume, run_dir)

    @property
    def failure(self) -> str | None:
        return self.outcome.failure

    @property
    def interrupted(self) -> int | None:
        return self.outcome.interrupted

    def resume_from(self, record: dict, run_dir: Path) -> None:
        """Continue a run whose controller died, from its committed checkpoint."""
        from flowrl.runtime.protocol.ledger import read_ledger

        step = record["step"]
        epoch = self.book.resume(record)
        self.scheduler.resume(step, record.get("version", step), read_ledger(run_dir),
                              record.get("scheduler", {}).get("replaced_below", 0))
        self.ledger.record(Resumed(step=step, epoch=epoch))
        for proc in self.procs:
            self.wiring.prepare_start(proc)

    # what several components do together ----------------------------------------------------
    async def flush(self) -> None:
        await self.desk.flush(held=self.recovery.active or bool(self.failure), epoch=self.book.epoch)

    def commit_if_ready(self) -> None:
        step = self.book.committable(self.scheduler.complete_below)
        if step is not None:
            # the rows of the steps it counts go to metrics.jsonl first: after a crash, a resume
            # starts past them and never writes them again (they waited in the report's backlog)
            self.report.catch_up()
            self.book.commit(step, self.scheduler.state_dict(step))
            prune_shards(self.book, self.restarts.launcher, self.book.root.parent)  # host folders, checkpoint_uri
            log.info("checkpoint %d committed", step)

    async def begin_recovery(self, reason: str) -> None:
        self.desk.drop_pending()
        self.sync.disband()
        await self.recovery.begin(reason)

    async def recovered(self) -> None:
        """The recovery epoch is complete: clocks restart, weights sync again, tickets go out."""
        self.scheduler.restart_clock()
        await self.sync.form(self.scheduler.version)
        await self.flush()

    async def on_down(self, down: list[tuple[Proc, str]]) -> None:
        """Processes seen down together: each restarts (with its rank group) or the run fails, and one
        recovery epoch for those that held state (one each rolled every stateful node back as often)."""
        lost, others = [], []
        for proc, why in down:
            if proc.down_since is not None:  # taken down with its rank group a moment ago (one record, one restart)
                continue
            if not self.restarts.on_down(proc, why):
                return
            await self.wiring.turns.down(proc)  # a dead member holds no turn: its partner goes on
            (lost if proc.spec.node in self.roles.stateful else others).append((proc, why))
        if lost:
            await self.begin_recovery("; ".join(f"{proc.id} {why}" for proc, why in lost))
        elif self.recovery.active:
            for proc, _ in others:
                self.recovery.also_wait_for(p.id for p in self.restarts.rank_group(proc))
        elif others:  # weight sync goes on without them (and their rank groups); they join a new epoch once wired again
            await self.sync.follow(self.scheduler.version, recovering=False)

    async def supervise(self) -> None:
        ended, why = await self.recovery.watch()
        if why:
            self.outcome.fail(None, why)
            return
        if ended:
            await self.recovered()
        self.retirement.reap()
        await self.on_down(self.restarts.down())
        if self.failure:
            return
        for proc in self.restarts.due():
            self.restarts.restart(proc)

    async def on_step(self, staleness) -> None:
        """A ticket completed; with `ticket: group` an update's row waits for its last group."""
        sched, per = self.scheduler, self.spec.schedule.tickets_per_update
        if not self.roles.publishers:
            sched.set_version(sched.completed // per)
        self.report.ticket(sched.completed, per, sched.version, staleness, sched.done)
        self.commit_if_ready()
        if self.desk.end_moved():  # a replaced ticket: nodes learn the new end first
            self.report.total_steps(-(-sched.steps // per))
            await self.desk.progress()
        await self.flush()

    # messages from nodes: one handler per type ----------------------------------------------
    async def on_heartbeat(self, proc: Proc, msg: m.Heartbeat) -> None:
        if msg.busy is not None and len(msg.busy) == 2 and isinstance(msg.busy[1], (int, float)):
            proc.busy = (str(msg.busy[0]), float(msg.busy[1]))
            self.desk.seen_busy(proc.busy[0], proc.id)
        elif msg.metrics is None:
            proc.busy = None
        self.report.ingest(proc, msg.metrics)

    async def on_ready(self, proc: Proc, msg: m.Ready) -> None:
        proc.ready = True
        proc.pid = msg.pid
        proc.store_port = msg.store_port
        if proc.retired:  # removed by `flowrl scale` while it (re)started: its Stop found no one
            await self.control.send(proc, m.Stop())
            return
        await self.wiring.on_bound(proc, msg.inputs)
        await self.wiring.turns.ready(proc)
        self.report.node_up(proc, True)
        await self.wiring.after_ready(proc)

    async def on_wired(self, proc: Proc, msg: m.Wired) -> None:
        proc.wired = True
        if proc.retired:
            return
        sched = self.scheduler
        if sched.steps != self.spec.schedule.total_tickets:  # the end moved since its spec was written
            await self.control.send(proc, m.Progress(complete_below=sched.complete_below, steps=sched.steps))
        if self.recovery.active:
            if msg.epoch == self.book.epoch:
                if self.recovery.entered(proc, msg.epoch):
                    await self.recovered()
            else:  # it was starting when the rollback began: it rolls back now
                await self.control.send(proc, self.recovery.order_for(proc))
            return
        await self.sync.joined(proc, sched.version)  # a weight process joins the next epoch
        if proc.spec.incarnation > proc.first_incarnation and proc.spec.rank == 0:
            # a restarted stateless node: what it held goes out again
            self.desk.drop_pending()
            await self.desk.reissue(sched.reissue_open, f"{proc.id} restarted")
        await self.flush()

    async def on_consumed(self, proc: Proc, msg: m.Consumed) -> None:
        self.report.ingest(proc, msg.metrics)
        if proc.spec.node in self.roles.stateful and msg.epoch != self.book.epoch:
            self.ledger.record(DuplicateDropped(batch_id=msg.batch_id, attempt=msg.attempt, node=proc.id, why="older epoch"))
            return
        if self.desk.consumed(proc.spec.node, msg):
            await self.on_step(msg.staleness)

    async def on_published(self, proc: Proc, msg: m.Published) -> None:
        if msg.digest:
            self.ledger.record(WeightsHeld(node=proc.id, version=msg.version, digest=msg.digest))
        if msg.epoch == self.book.epoch:
            self.scheduler.set_version(msg.version)
            await self.flush()  # its tickets go now, before the orders: at k=0 the batch's way is the longer
            await self.sync.order(msg.version, recovering=self.recovery.active)

    async def on_synced(self, proc: Proc, msg: m.Synced) -> None:
        self.sync.synced(proc, msg)

    async def on_sync_failed(self, proc: Proc, msg: m.SyncFailed) -> None:
        await self.sync.sync_failed(proc, msg, self.scheduler.version, recovering=self.recovery.active)

    async def on_checkpointed(self, proc: Proc, msg: m.Checkpointed) -> None:
        shard = None if msg.sha256 is None else {"sha256": msg.sha256, "size": msg.size, "host": proc.spec.host,
                                                  "folder": str(Path(proc.spec.home).absolute()),
                                                  **({"copy": msg.copy} if msg.copy else {})}
        self.book.report(proc.id, step=msg.step, epoch=msg.epoch, file=msg.file, version=msg.version, shard=shard)
        self.commit_if_ready()

    async def on_recovered(self, proc: Proc, msg: m.Recovered) -> None:
        if self.recovery.entered(proc, msg.epoch):
            await self.recovered()

    async def on_duplicate(self, proc: Proc, msg: m.Duplicate) -> None:
        self.ledger.record(DuplicateDropped(batch_id=msg.batch_id, attempt=msg.attempt, node=proc.id, why=msg.why))
        self.desk.dropped(proc.id, msg)  # one refused at a node's boundary is said at once

    async def on_error(self, proc: Proc, msg: m.Error) -> None:
        proc.error = NodeFailure(msg.where, msg.type, msg.message, msg.file, msg.line, msg.batch_id, msg.traceback)

    HANDLERS = {m.Heartbeat: on_heartbeat, m.Ready: on_ready, m.Wired: on_wired, m.Consumed: on_consumed,
                m.Published: on_published, m.Synced: on_synced, m.SyncFailed: on_sync_failed,
                m.Checkpointed: on_checkpointed, m.Recovered: on_recovered, m.Duplicate: on_duplicate,
                m.Error: on_error, m.TurnAsk: lambda self, p, msg: self.wiring.turns.on_ask(p, msg),
                m.TurnReleased: lambda self, p, msg: self.wiring.turns.on_released(p, msg)}

    # the control socket -----------------------------------------------------------------------
    async def receive_loop(self) -> None:
        while True:
            if self.report.backlog and not self.sync.in_round() and not await self.control.readable(IDLE_S):
                self.report.catch_up()  # metrics work once the socket is quiet, not between two orders
                continue
            await self.receive_one()

    async def receive_one(self, only: type | None = None) -> None:
        """Take one control message and act on it (only messages of type `only`, if given)."""
        got = await self.control.receive(self.procs)
        if got is None:
            return
        kind, who, what = got
        if kind == "client":
            if only is None:
                await self.on_client(who, what)
            return
        if only is not None and not isinstance(what, only):
            return
        handler = self.HANDLERS.get(type(what))
        self.procs.seen(who)
        if handler is not None:
            await handler(self, who, what)

    async def on_client(self, identity: bytes, data: bytes) -> None:
        """A request from `flowrl scale` (or `flowrl.scale`): answered on the same socket."""
        msg = self.control.client_request(data)
        if msg is None:
            return
        try:
            text = await scale(msg.node, msg.replicas, spec=self.spec, roles=self.roles, procs=self.procs,
                               wiring=self.wiring, launch=self.restarts.launch, send=self.control.send, sync=self.sync,
                               retirement=self.retirement, report=self.report, ledger=self.ledger,
                               recovering=self.recovery.active, version=self.scheduler.version, planfile=self.wiring.planfile)
            reply = m.Scaled(ok=True, message=text)
        except ScaleError as e:
            reply = m.Scaled(ok=False, message=str(e))
        await self.control.reply(identity, reply)

    # lifetime -------------------------------------------------------------------------------
    async def run(self) -> int:
        for proc in self.procs:
            self.restarts.launch(proc)
        wait_s = self.spec.controller.final_checkpoint_wait_s
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.receive_loop)
                tg.start_soon(self.watch_signals, tg.cancel_scope)
                await self.loop_until(lambda: self.scheduler.done and not self.recovery.active)
                if not self.failure and self.roles.stateful:  # the final checkpoint: a finished run can be extended
                    with anyio.move_on_after(wait_s):
                        await self.loop_until(lambda: self.book.committed_step == self.scheduler.steps)
                    if self.book.committed_step != self.scheduler.steps:
                        log.warning("the final checkpoint (step %d) was not committed within %g s "
                                    "(controller.final_checkpoint_wait_s); the last committed one is step %s",
                                    self.scheduler.steps, wait_s, (self.book.committed or {}).get("step"))
                if self.scheduler.replace_refused:
                    log.warning("%d tickets dropped with replace=True were not replaced (schedule.max_replaced=%d "
                                "reached): the run made fewer updates than schedule.steps; raise max_replaced",
                                self.scheduler.replace_refused, self.scheduler.max_replaced)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.shutdown()
        if self.failure:
            raise RunFailed(self.failure)
        return 0

    async def loop_until(self, condition) -> None:
        tick_s = self.spec.controller.tick_s
        while not self.failure and not condition():
            await self.supervise()
            await self.flush()
            await self.desk.progress()
            self.report.tick(self)
            await anyio.sleep(tick_s)

    async def watch_signals(self, scope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                self.outcome.interrupt(signum)
                scope.cancel()
                return

    async def shutdown(self) -> None:
        for proc in self.procs:
            if proc.ready and proc.alive:
                await self.control.send(proc, m.Stop())
        deadline = time.monotonic() + self.spec.supervision.stop_timeout_s
        while time.monotonic() < deadline and (any(p.alive for p in self.procs) or await self.control.readable(QUIET_S)):
            with anyio.move_on_after(self.spec.controller.tick_s):  # the last metrics each node sends on its way out
                await self.receive_one(only=m.Heartbeat)  # (also after the last exit: they may wait here unread)
        self.report.write_last_row()  # the last step's row, with those last metrics in it
        for proc in self.procs:
            if proc.handle:
                proc.handle.stop(1.0)
        self.ledger.close()
        self.control.close()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.handle:
                proc.handle.signal(signal.SIGKILL)
