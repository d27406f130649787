"""The controller: spawns node processes, runs the scheduler, supervises, checkpoints, recovers.

It never carries batch payloads — data flows node to node over the edges' channels; the controller
only handles the control plane. Each invariant has its own home and the controller wires them:

    Supervisor     launch, watch (exit, READY, heartbeats, process timeout), restart budget
    Scheduler      tickets under the staleness bound, per-sink consumption, re-issue, max attempts
    RecoveryBook   consistent checkpoints, recovery epochs, rollback target, pruning
    messages       the typed control messages (one dataclass each)

Recovery (docs/recovery.md): a stateless node that dies is restarted and the open tickets are
issued again. A stateful node that dies opens a new recovery epoch: issuing pauses, every stateful
node loads the last committed checkpoint, every node drops batches of older epochs, the weights
are re-broadcast from the restored trainer, and the tickets from the checkpoint's step on go out
again.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from flowrl.errors import FlowrlError
from flowrl.runtime import messages as m
from flowrl.runtime.addresses import Network, bind_control, release_control
from flowrl.runtime.launcher import Launcher
from flowrl.runtime.ledger import Ledger
from flowrl.runtime.procs import NodeFailure, Proc, ProcTable
from flowrl.runtime.procspec import OutputRoute, ProcSpec
from flowrl.runtime.ranks import shard_address
from flowrl.runtime.recovery import RecoveryBook
from flowrl.runtime.scheduler import Scheduler, TicketExhausted
from flowrl.runtime.supervisor import Supervisor

log = logging.getLogger("flowrl.controller")


class RunFailed(FlowrlError):
    """The run could not reach its configured end; the message says which node and why."""


def node_shapes(classes: dict) -> dict[str, list[str]]:
    """Which nodes are sources, sinks, observers, stateful, publishers and subscribers."""
    from flowrl.node import Source

    observers = [n for n, c in classes.items() if not issubclass(c, Source) and not c.inputs and not c.outputs]
    return {"sources": [n for n, c in classes.items() if issubclass(c, Source)],
            "sinks": [n for n, c in classes.items() if not c.outputs and n not in observers],
            "observers": observers,
            "stateful": [n for n, c in classes.items() if c.stateful]}


class Controller:
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
        from flowrl.runtime.scaling import write_control_file

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
        self.pending_tickets: list = []
        self.source_rr = 0
        self.stuck_at: dict[str, str] = {}  # batch id -> the process last seen busy with it
        self.rejected = 0
        self.failure: str | None = None
        self.interrupted = None
        self.started = False
        self.last_progress, self.progress_sent, self.steps_sent = 0.0, -1, sched.steps
        if resume:
            self.resume_from(resume)

    # set-up -----------------------------------------------------------------------------------
    def address(self, node: str, replica: int, port: str) -> str:
        return self.bound.get((node, replica, port)) or self.net.input_address(node, replica, port)

    def routes_for(self, proc: Proc) -> dict:
        """edge -> [[address, CURVE key], ...] of each consumer replica, as bound now (for Wire)."""
        out = {}
        for route in proc.spec.outputs:
            e = next(e for e in self.spec.edges if str(e) == route.edge)
            out[route.edge] = [[a, self.net.server_key(e.dst, r, a)] for r in range(self.spec.nodes[e.dst].replicas)
                               for a in [self.address(e.dst, r, e.dst_port)]]
        return out

    async def on_bound(self, proc: Proc, inputs: dict | None) -> None:
        """A consumer reported the addresses it bound: a restart binds them again; a consumer that
        moved (re-plan) or got another port is reached there by every wired producer."""
        ps = proc.spec
        for port, address in (inputs or {}).items():
            if port not in ps.inputs or not isinstance(address, str):
                continue
            key = (ps.node, ps.replica, port)
            old = self.bound.get(key)
            self.bound[key] = ps.inputs[port] = address
            if old is None or old == address:
                continue
            for e in [e for e in self.spec.edges if e.dst == ps.node and e.dst_port == port]:
                for p in self.procs.of_node(e.src):
                    if p.ready and p.down_since is None:  # it got Wire already (or gets these routes in it)
                        await self.send(p, m.Connect(edge=str(e), address=address,
                                                     key=self.net.server_key(ps.node, ps.replica, address) or None))
                        await self.send(p, m.Disconnect(edge=str(e), address=old))

    def build_procs(self) -> None:
        master_ports: dict[tuple, int] = {}
        for entry in self.plan.entries:
            group = (entry.node, entry.replica)
            if group not in master_ports:
                master_ports[group] = free_port()
            self.procs.add(Proc(spec=self.proc_spec(entry, master_ports[group])))

    def proc_spec(self, entry, master_port: int) -> ProcSpec:
        """What process `entry` of the plan is told about itself (written as JSON before it starts)."""
        spec = self.spec
        cls = self.classes[entry.node]
        node = spec.nodes[entry.node]
        pid = f"{entry.node}/{entry.replica}/{entry.rank}"
        if pid not in self.net.where:  # a replica added by `flowrl scale`
            self.net.place(pid, self.launcher.host_address(entry.host))
        inputs = {p: self.address(entry.node, entry.replica, p) for p in cls.inputs}
        clients = {p: c for p in cls.inputs for c in [self.net.input_clients(entry.node, entry.replica, p)] if c is not None}
        outputs = [OutputRoute(edge=str(e), port=e.src_port,
                               addresses=[self.address(e.dst, r, e.dst_port) for r in range(spec.nodes[e.dst].replicas)],
                               capacity=e.capacity, capacity_bytes=e.capacity_bytes)
                   for e in spec.edges if e.src == entry.node]
        env = dict(self.plan.env_for(entry, master_port=master_port))
        rank_addresses = ([shard_address(str(self.sockdir), entry.node, entry.replica, r)
                           for r in range(entry.world_size)] if entry.world_size > 1 else [])
        return ProcSpec(node=entry.node, kind=node.kind, replica=entry.replica, replicas=node.replicas,
                        rank=entry.rank, world_size=entry.world_size, incarnation=0, run_dir=str(self.run_dir),
                        graph_file=str(self.run_dir / "graph.yaml"), control=self.net.control_address(pid), inputs=inputs,
                        outputs=outputs, env=env, device_type=entry.device_type, devices=list(entry.devices),
                        cpu_cores=list(entry.local_devices) if entry.device_type == "cpu" else [],
                        is_sink=entry.node in self.sinks, is_source=entry.node in self.sources,
                        faults=self.faults, heartbeat_s=spec.supervision.heartbeat_s, secret=self.secret,
                        serving_dtype=next((spec.nodes[w.dst].dtype for w in spec.weights if w.src == entry.node), None),
                        sys_path=[p for p in sys.path if p and os.path.isdir(p)], rank_addresses=rank_addresses,
                        host=getattr(entry, "host", None), host_address=self.net.where[pid],
                        curve_public=self.net.keys[pid][0], curve_secret=self.net.keys[pid][1],
                        control_key=self.net.control_key(pid), input_clients=clients)

    def resume_from(self, record: dict) -> None:
        """Continue a run whose controller died, from its committed checkpoint."""
        from flowrl.runtime.ledger import read_ledger

        step = record["step"]
        self.book.committed = record
        self.book.epoch = record.get("epoch", 0) + 1
        self.scheduler.resume(step, record.get("version", step), self.book.epoch,
                              read_ledger(self.run_dir), record.get("scheduler", {}).get("replaced_below", 0))
        self.ledger.write("resumed", "-", 0, step=step, epoch=self.book.epoch)
        for proc in self.procs:
            self.prepare_start(proc)

    def prepare_start(self, proc: Proc) -> None:
        """Where a (re)started process begins: the current epoch, the committed checkpoint."""
        ps = proc.spec
        ps.epoch = self.book.epoch
        ps.steps = self.scheduler.steps
        committed = self.book.committed
        if ps.node in self.stateful:
            ps.resume_from = self.book.file_for(proc.id)
            ps.watermark = committed["step"] if committed else 0
        elif ps.node in self.sinks:
            ps.watermark = self.scheduler.complete_below
            ps.consumed = self.scheduler.consumed_above(ps.node, ps.watermark)

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

    # supervision ------------------------------------------------------------------------------
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
        self.sync_members = []
        self.recovering = {p.id for p in self.procs}
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
        if not self.recovering:
            self.recovering = None
            self.scheduler.restart_clock()
            log.warning("recovery epoch %d complete", self.book.epoch)
            await self.new_sync_epoch()
            await self.flush_tickets()

    def restart(self, proc: Proc) -> None:
        if self.launcher.is_lost(proc.spec.host):  # its whole host left: its processes move (replan.py)
            from flowrl.runtime.replan import move_off

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

    async def on_client(self, identity: bytes, data: bytes) -> None:
        """A request from `flowrl scale` (or `flowrl.scale`): answered on the same socket."""
        from flowrl.runtime.scaling import ScaleError, scale

        try:
            msg = m.decode(data)
        except m.ControlError:
            self.rejected += 1
            return
        if not isinstance(msg, m.Scale) or not hmac.compare_digest(msg.k or "", self.secret):
            self.rejected += 1
            return
        try:
            reply = m.Scaled(ok=True, message=await scale(self, msg.node, msg.replicas))
        except ScaleError as e:
            reply = m.Scaled(ok=False, message=str(e))
        try:
            await self.router.send_multipart([identity, m.encode(reply)])
        except zmq.ZMQError:
            pass

    def retire_stopped(self) -> None:
        """Forget processes removed by `flowrl scale` once they are gone."""
        for proc in [p for p in self.procs if p.retired and not p.alive and p.handle]:
            del self.procs.procs[proc.id]
            self.sync_members = [p for p in self.sync_members if p is not proc]
            if self.hub:
                self.hub.forget(proc.spec.node, proc.spec.replica)

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
            await self.on_bound(proc, msg.inputs)
            if self.hub:
                self.hub.set("node_up", 1, node=proc.spec.node, replica=str(proc.spec.replica), across="min")
            await self.after_ready(proc)
        elif isinstance(msg, m.Wired):
            proc.wired = True
            await self.after_wired(proc, msg.epoch)
        elif isinstance(msg, m.Consumed):
            await self.on_consumed(proc, msg)
        elif isinstance(msg, m.Published):
            if msg.digest:
                self.ledger.write("weights", "-", 0, node=proc.id, version=msg.version, digest=msg.digest)
            if msg.epoch == self.book.epoch:
                self.scheduler.set_version(msg.version)
                await self.order_sync(msg.version)
        elif isinstance(msg, m.Synced):
            proc.version = msg.version
            self.sync_failures = 0
            if msg.digest:
                self.ledger.write("weights", "-", 0, node=proc.id, version=msg.version, digest=msg.digest)
        elif isinstance(msg, m.SyncFailed):
            log.warning("weight sync failed at %s: %s", proc.id, msg.error)
            if msg.permanent:
                self.fail(proc, f"cannot take the trainer's weights: {msg.error}; every node that holds the "
                                "policy must build the same model (share it with a YAML anchor under vars:)")
            elif msg.sync_epoch == self.sync_epoch and self.recovering is None:
                self.sync_failures += 1
                if self.sync_failures > 5:
                    self.fail(proc, f"weight sync failed {self.sync_failures} times in a row; last: {msg.error}")
                else:
                    await self.new_sync_epoch()
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

    async def after_ready(self, proc: Proc) -> None:
        """Wire outputs once every consumer can receive: all at the start, a restarted one at once."""
        if not self.started:
            if all(p.ready for p in self.procs):
                self.started = True
                for p in self.procs:
                    await self.send(p, m.Wire(routes=self.routes_for(p)))
            return
        await self.send(proc, m.Wire(routes=self.routes_for(proc)))

    async def after_wired(self, proc: Proc, epoch: int) -> None:
        if self.scheduler.steps != self.spec.schedule.steps:  # the end moved since its spec was written
            await self.send(proc, m.Progress(complete_below=self.scheduler.complete_below, steps=self.scheduler.steps))
        if self.recovering is not None:
            if epoch == self.book.epoch:
                await self.entered(proc)
            else:  # it was starting when the rollback began: it rolls back now
                await self.send(proc, self.epoch_order(proc, self.book.epoch))
            return
        if proc in self.weight_procs():
            if all(p.ready and p.wired for p in self.weight_procs()):
                await self.new_sync_epoch()
        if proc.spec.incarnation > 0 and proc.spec.rank == 0:  # a restarted stateless node: what it held goes out again
            self.pending_tickets = []
            await self.reissue(self.scheduler.reissue_open, f"{proc.id} restarted")
        await self.flush_tickets()

    # weight sync ----------------------------------------------------------------------------
    def weight_procs(self) -> list[Proc]:
        """Rank 0 of each publisher (its weights are whole there) and every rank of every subscriber."""
        return [p for p in self.procs if (p.spec.node in self.publishers and p.spec.rank == 0)
                or p.spec.node in self.subscribers]

    async def new_sync_epoch(self) -> None:
        """Form a fresh weight-sync group of every live member and send the newest weights."""
        members = [p for p in self.weight_procs() if p.ready and p.wired and p.down_since is None]
        pubs = [p for p in members if p.spec.node in self.publishers]
        if not pubs or len(members) < 2:
            self.sync_members = []
            return
        self.sync_epoch += 1
        self.sync_members = pubs[:1] + [p for p in members if p.spec.node in self.subscribers]
        await self.order_sync(self.scheduler.version)

    async def order_sync(self, version: int) -> None:
        if not self.sync_members or self.recovering is not None:
            return
        pub = self.sync_members[0]
        sup = self.spec.supervision
        for rank, p in enumerate(self.sync_members):
            await self.send(p, m.Sync(sync_epoch=self.sync_epoch, version=version, rank=rank,
                                      world_size=len(self.sync_members), store=[pub.spec.host_address, pub.store_port],
                                      timeout_s=max(30.0, sup.deadline_s * 4)))

    # steps and checkpoints ----------------------------------------------------------------------
    async def on_step(self, msg) -> None:
        sched = self.scheduler
        if not self.publishers:
            sched.set_version(sched.completed)
        if self.hub:
            from flowrl.metrics import write_status

            self.hub.end_step(step=sched.completed, policy_version=sched.version,
                              extra={"staleness_max": msg.staleness})
            write_status(self.run_dir, self.hub.live_state(), phase="running", graph=self.summary)
        self.maybe_commit()
        if self.scheduler.steps != self.steps_sent:  # a replaced ticket: nodes learn the new end first
            if self.summary is not None:
                self.summary["total_steps"] = self.scheduler.steps  # the live view's "step i/N"
            await self.progress()
        await self.flush_tickets()

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


def make_sockdir() -> Path:
    """A private folder for this run's sockets; folders of runs whose controller died go first."""
    tmp = Path(tempfile.gettempdir())
    for old in tmp.glob("flowrl-*"):
        try:
            pid = int((old / "pid").read_text())
            if old.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except (OSError, ValueError):
            continue
    path = Path(tempfile.mkdtemp(prefix="flowrl-"))
    os.chmod(path, 0o700)
    (path / "pid").write_text(str(os.getpid()))
    return path


def free_port() -> int:
    """A free TCP port on loopback for a node's own torch.distributed group (MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
