"""The controller: spawns node processes, runs the scheduler, supervises, checkpoints, recovers.

It never carries batch payloads — data flows node to node over the edges' channels; the controller
only handles the control plane. Each invariant has its own home and the controller wires them:

    Supervisor     launch, watch (exit, READY, heartbeats, process timeout), restart budget
    Scheduler      tickets under the staleness bound, per-sink consumption, re-issue, max attempts
    RecoveryBook   consistent checkpoints, recovery epochs, rollback target, pruning
    messages       the typed control messages (one dataclass each)

The controller's own work is split by responsibility into mixins of `Controller`; this module
keeps the state they share, the control socket (receive, dispatch, send) and the run's lifetime:

    Wiring         process specs, start points, bound addresses, routes (wiring.py)
    Restarts       a process down: restart, rank groups, recovery epochs and their deadline (restarts.py)
    WeightOrders   weight-sync epochs and Sync orders (weightorders.py)
    Tickets        issuing tickets, consumption, steps, commits, progress (tickets.py)
    ScaleClient    `flowrl scale` requests on the control socket (scaling.py)

Recovery (docs/recovery.md): a stateless node that dies is restarted and the open tickets are
issued again. A stateful node that dies opens a new recovery epoch: issuing pauses, every stateful
node loads the last committed checkpoint, every node drops batches of older epochs, the weights
are re-broadcast from the restored trainer, and the tickets from the checkpoint's step on go out
again.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import shutil
import signal
import time
from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from flowrl.graph.shapes import node_shapes  # re-exported: the rule lives below the runtime
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.errors import RunFailed
from flowrl.runtime.protocol.addresses import Network, bind_control, release_control
from flowrl.runtime.launch.launcher import Launcher
from flowrl.runtime.protocol.ledger import Ledger
from flowrl.runtime.controller.procs import NodeFailure, Proc, ProcTable
from flowrl.runtime.controller.recovery import RecoveryBook
from flowrl.runtime.controller.restarts import Restarts
from flowrl.runtime.controller.scaling import ScaleClient
from flowrl.runtime.controller.scheduler import Scheduler
from flowrl.runtime.controller.supervisor import Supervisor
from flowrl.runtime.controller.tickets import Tickets
from flowrl.runtime.controller.weightorders import WeightOrders
from flowrl.runtime.controller.wiring import Wiring, free_port, make_sockdir

__all__ = ["Controller", "RunFailed", "node_shapes", "make_sockdir", "free_port"]

log = logging.getLogger("flowrl.controller")


class Controller(Wiring, Restarts, WeightOrders, Tickets, ScaleClient):
    def __init__(self, spec, plan, run_dir: Path, launcher: Launcher, *, faults: list[str] = (),
                 resume: dict | None = None, hub=None, on_tick=None, summary: dict | None = None,
                 inventory: str | None = None):
        from flowrl.graph import node_classes

        self.spec, self.plan, self.run_dir = spec, plan, run_dir
        self.faults = list(spec.faults) + list(faults)
        self.classes = node_classes(spec)
        self.hub, self.on_tick, self.summary = hub, on_tick, summary
        shapes = node_shapes(self.classes)
        self.sources, self.sinks, self.stateful = shapes["sources"], shapes["sinks"], shapes["stateful"]
        self.publishers = [w.src for w in spec.weights]
        self.subscribers = [w.dst for w in spec.weights]
        self.secret = secrets.token_hex(16)
        self.launcher = launcher
        # where every process runs decides its links (addresses.py); a host the launcher cannot
        # place fails the run here, before anything is made
        self.net = Network(spec, self.classes, "", launcher.controller_address(), curve=spec.launcher.curve)
        for entry in plan.entries:
            self.net.place(f"{entry.node}/{entry.replica}/{entry.rank}", launcher.host_address(entry.host))
        try:
            self.net.check_ranks(plan.groups())
        except ValueError as e:
            raise RunFailed(str(e)) from None
        self.sockdir = make_sockdir()
        self.net.sockdir = str(self.sockdir)
        self.bound: dict[tuple, str] = {}  # (node, replica, port) -> the address that consumer bound
        self.zctx, self.router = bind_control(self.net)
        self.control_addr = f"ipc://{self.sockdir}/control"
        self.inventory = inventory
        from flowrl.runtime.controller.scaling import write_control_file

        write_control_file(run_dir, self.control_addr, self.secret)
        for sub in ("logs", "procs", "checkpoints"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        sched, sup = spec.schedule, spec.supervision
        self.ledger = Ledger(run_dir / "ledger.jsonl")
        self.scheduler = Scheduler(steps=sched.steps, batch_size=sched.batch_size, max_staleness=sched.max_staleness,
                                   sinks=self.sinks, stateful_sinks=[s for s in self.sinks if s in self.stateful],
                                   ticket_timeout_s=sched.ticket_timeout_s, max_attempts=sched.max_attempts,
                                   max_replaced=sched.max_replaced, ledger=self.ledger)
        self.procs = ProcTable()
        self.supervisor = Supervisor(launcher, run_dir, sup, {n: node.on_failure for n, node in spec.nodes.items()})
        self.build_procs()
        members = [p.id for p in self.procs if p.spec.node in self.stateful]  # every rank saves its own state
        self.book = RecoveryBook(run_dir, members, keep=sched.keep_checkpoints, ledger=self.ledger,
                                 publishers=self.publishers)
        self.recovering: set[str] | None = None
        self.sync_epoch = 0
        self.sync_failures = 0
        self.sync_members: list[Proc] = []
        self.sync_identities: frozenset[bytes] = frozenset()  # who the current sync epoch was formed of
        self.retiring: list[Proc] = []  # removed replicas still stopping whose id a new replica took
        self.pending_tickets: list = []
        self.source_rr = 0
        self.stuck_at: dict[str, str] = {}  # batch id -> the process last seen busy with it
        self.rejected = 0
        self.failure: str | None = None
        self.interrupted = None
        self.started = False
        self.last_progress, self.progress_sent, self.steps_sent = 0.0, -1, sched.steps
        self.last_row: dict | None = None  # the last step's row, written once the nodes have stopped
        if resume:
            self.resume_from(resume)

    # messages to nodes ------------------------------------------------------------------------
    async def send(self, proc: Proc, msg) -> bool:
        try:
            await self.router.send_multipart([proc.identity, m.encode(msg)])
            return True
        except zmq.ZMQError:  # not connected (yet, or any more): the caller retries or replays
            return False

    def fail(self, proc: Proc | None, why: str) -> None:
        if self.failure:
            return
        self.failure = self.supervisor.describe(proc, why) if proc is not None else why
        self.ledger.write("failed", "-", 0, why=self.failure.splitlines()[0][:500])
        log.error("run failed: %s", self.failure)

    async def supervise(self) -> None:
        await self.watch_recovery()
        self.retire_stopped()
        for proc, why in self.supervisor.check([p for p in self.procs if not p.retired]):
            await self.on_down(proc, why)
            if self.failure:
                return
        for proc in self.supervisor.due(self.procs):
            self.restart(proc)

    # messages from nodes ---------------------------------------------------------------------
    async def receive_loop(self) -> None:
        while True:
            await self.receive_one()

    async def receive_one(self, only: type | None = None) -> None:
        """Take one control message and act on it (only messages of type `only`, if given)."""
        frames = await self.router.recv_multipart()
        if len(frames) != 2:
            self.rejected += 1
            return
        identity, data = frames
        if identity.startswith(b"client#"):
            if only is None:
                await self.on_client(identity, data)
            return
        proc, current = self.procs.by_identity(identity)
        if proc is None or not current:
            return  # a stranger, or an old incarnation's last words
        try:
            msg = m.decode(data)
        except m.ControlError as e:
            self.rejected += 1
            log.warning("bad control message from %s: %s", proc.id, e)
            return
        if not hmac.compare_digest(msg.k or "", self.secret):
            self.rejected += 1
            log.warning("control message for %s without the run's secret: dropped", proc.id)
            return
        if only is None or isinstance(msg, only):
            await self.on_message(proc, msg)

    async def on_message(self, proc: Proc, msg) -> None:
        self.procs.seen(proc)
        if isinstance(msg, m.Heartbeat):
            if msg.busy is not None and len(msg.busy) == 2 and isinstance(msg.busy[1], (int, float)):
                proc.busy = (str(msg.busy[0]), float(msg.busy[1]))
                if proc.busy[0] in self.open_ids():
                    self.stuck_at[proc.busy[0]] = proc.id
            elif msg.metrics is None:
                proc.busy = None
            self.ingest(proc, msg.metrics)
        elif isinstance(msg, m.Ready):
            proc.ready = True
            proc.pid = msg.pid
            proc.store_port = msg.store_port
            if proc.retired:  # removed by `flowrl scale` while it (re)started: its Stop found no one
                await self.send(proc, m.Stop())
                return
            await self.on_bound(proc, msg.inputs)
            if self.hub:
                self.hub.set("node_up", 1, node=proc.spec.node, replica=str(proc.spec.replica), across="min")
            await self.after_ready(proc)
        elif isinstance(msg, m.Wired):
            proc.wired = True
            if not proc.retired:
                await self.after_wired(proc, msg.epoch)
        elif isinstance(msg, m.Consumed):
            await self.on_consumed(proc, msg)
        elif isinstance(msg, (m.Published, m.Synced, m.SyncFailed)):
            await self.on_weights(proc, msg)
        elif isinstance(msg, m.Checkpointed):
            self.book.report(proc.id, step=msg.step, epoch=msg.epoch, file=msg.file, version=msg.version)
            self.maybe_commit()
        elif isinstance(msg, m.Recovered):
            if msg.epoch == self.book.epoch:
                await self.entered(proc)
        elif isinstance(msg, m.Duplicate):
            self.ledger.write("duplicate_dropped", msg.batch_id, msg.attempt, node=proc.id, why=msg.why)
        elif isinstance(msg, m.Error):
            proc.error = NodeFailure(msg.where, msg.type, msg.message, msg.file, msg.line, msg.batch_id, msg.traceback)

    def ingest(self, proc: Proc, metrics: dict | None) -> None:
        if metrics and self.hub:
            try:
                self.hub.ingest(metrics)
            except Exception as e:  # noqa: BLE001 - a bad snapshot is dropped, the run goes on
                log.warning("dropped a metrics snapshot from %s: %s", proc.id, e)

    async def after_wired(self, proc: Proc, epoch: int) -> None:
        if self.scheduler.steps != self.spec.schedule.steps:  # the end moved since its spec was written
            await self.send(proc, m.Progress(complete_below=self.scheduler.complete_below, steps=self.scheduler.steps))
        if self.recovering is not None:
            if epoch == self.book.epoch:
                await self.entered(proc)
            else:  # it was starting when the rollback began: it rolls back now
                await self.send(proc, self.epoch_order(proc, self.book.epoch))
            return
        if proc in self.weight_procs():  # it joins the next epoch, with every other member now starting
            if all(p.ready and p.wired for p in self.weight_procs() if p.down_since is None):
                await self.new_sync_epoch()
        if proc.spec.incarnation > proc.first_incarnation and proc.spec.rank == 0:
            # a restarted stateless node: what it held goes out again
            self.pending_tickets = []
            await self.reissue(self.scheduler.reissue_open, f"{proc.id} restarted")
        await self.flush_tickets()

    # lifetime -------------------------------------------------------------------------------
    async def run(self) -> int:
        for proc in self.procs:
            self.supervisor.launch(proc)
            if self.hub:
                self.hub.set("node_up", 0, node=proc.spec.node, replica=str(proc.spec.replica), across="min")
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.receive_loop)
                tg.start_soon(self.watch_signals, tg.cancel_scope)
                await self.loop_until(lambda: self.scheduler.done and self.recovering is None)
                if not self.failure and self.stateful:  # the final checkpoint: a finished run can be extended
                    with anyio.move_on_after(60):
                        await self.loop_until(lambda: (self.book.committed or {}).get("step") == self.scheduler.steps)
                    if (self.book.committed or {}).get("step") != self.scheduler.steps:
                        log.warning("the final checkpoint (step %d) was not committed within 60 s; the last "
                                    "committed one is step %s", self.scheduler.steps,
                                    (self.book.committed or {}).get("step"))
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
        while not self.failure and not condition():
            await self.supervise()
            await self.flush_tickets()
            await self.progress()
            if self.on_tick:
                self.on_tick(self)
            await anyio.sleep(0.05)

    async def watch_signals(self, scope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                self.failure = f"interrupted by {signal.Signals(signum).name}; every node process was stopped"
                self.interrupted = signum
                scope.cancel()
                return

    async def shutdown(self) -> None:
        for proc in self.procs:
            if proc.ready and proc.alive:
                await self.send(proc, m.Stop())
        deadline = time.monotonic() + self.spec.supervision.stop_timeout_s
        while any(p.alive for p in self.procs) and time.monotonic() < deadline:
            with anyio.move_on_after(0.05):  # the last metrics each node sends on its way out
                await self.receive_one(only=m.Heartbeat)
        self.write_last_row()  # the last step's row, with those last metrics in it
        for proc in self.procs:
            if proc.handle:
                proc.handle.stop(1.0)
        self.ledger.close()
        (self.run_dir / "control.json").unlink(missing_ok=True)
        self.router.close(linger=0)
        release_control(self.net, self.zctx)
        shutil.rmtree(self.sockdir, ignore_errors=True)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.handle:
                proc.handle.signal(signal.SIGKILL)
