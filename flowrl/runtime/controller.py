"""The controller: spawns node processes, runs the scheduler, supervises, checkpoints, tears down.

It never carries batch payloads — data flows node to node over the edges' channels; the controller
only handles the control plane (tickets, READY, heartbeats, consumption, weight-sync orders).

Supervision, in one place: a process that exits, is killed, reports an error, or misses heartbeats
for `supervision.deadline_s` is handled by its node's `on_failure` policy: `restart` (budget,
backoff; stateful nodes come back from their last checkpoint; every ticket in flight is re-issued)
or `fail` (the run ends with the node, pid, exit status and its last log lines).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from flowrl.graph.errors import FlowrlError
from flowrl.runtime import control
from flowrl.runtime.launcher import Launcher, describe_exit
from flowrl.runtime.procs import Proc, ProcTable
from flowrl.runtime.procspec import OutputRoute, ProcSpec
from flowrl.runtime.scheduler import Ledger, Scheduler

log = logging.getLogger("flowrl.controller")


class RunFailed(FlowrlError):
    """The run could not reach its configured end; the message says which node and why."""


class Controller:
    def __init__(self, spec, plan, run_dir: Path, launcher: Launcher, *, faults: list[str] = (),
                 resume: dict | None = None, hub=None, on_tick=None, summary: dict | None = None):
        from flowrl.graph import node_classes

        self.spec, self.plan, self.run_dir = spec, plan, run_dir
        self.launcher = launcher
        self.faults = list(spec.faults) + list(faults)
        self.classes = node_classes(spec)
        self.hub = hub
        self.on_tick = on_tick
        self.summary = summary
        self.sockdir = Path(tempfile.mkdtemp(prefix="flowrl-"))
        os.chmod(self.sockdir, 0o700)
        self.zctx = zmq.asyncio.Context()
        self.router = self.zctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.control_addr = f"ipc://{self.sockdir}/control"
        self.router.bind(self.control_addr)
        self.procs = ProcTable()
        self.sources = [n for n, c in self.classes.items() if not c.inputs]
        self.sinks = [n for n, c in self.classes.items() if not c.outputs]
        self.stateful = [n for n, c in self.classes.items() if c.stateful]
        self.publishers = [w.src for w in spec.weights]
        self.subscribers = [w.dst for w in spec.weights]
        sched = spec.schedule
        self.scheduler = Scheduler(steps=sched.steps, batch_size=sched.batch_size, max_staleness=sched.max_staleness,
                                   sinks=self.sinks, ticket_timeout_s=sched.ticket_timeout_s,
                                   ledger=Ledger(run_dir / "ledger.jsonl"))
        self.epoch = 0
        self.epoch_members: list[Proc] = []
        self.pending_tickets: list = []
        self.source_rr = 0
        self.checkpoints: dict[int, dict[str, list[str]]] = {}
        self.checkpoint_versions: dict[int, int] = {}
        self.last_checkpoint: dict | None = None
        self.failure: str | None = None
        self.t0 = time.monotonic()
        self.step_t = time.monotonic()
        self.resume = resume
        self.interrupted = None
        self.started = False
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "procs").mkdir(exist_ok=True)
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        if resume:
            self.resume_ledger(resume)
        self.build_procs()

    def resume_ledger(self, resume: dict) -> None:
        """Continue from a checkpoint: tickets consumed after it were lost with the trainer's
        state (rolled back), tickets in flight at it go out again."""
        from flowrl.runtime.scheduler import read_jsonl

        applied = set(resume["applied"])
        net: dict[str, int] = {}
        for row in read_jsonl(self.run_dir / "ledger.jsonl"):
            delta = {"consumed": 1, "rolled_back": -1}.get(row["event"], 0)
            net[row["batch_id"]] = net.get(row["batch_id"], 0) + delta
        self.scheduler.load_state_dict(resume["scheduler"], applied=applied,
                                       version=resume.get("version") if self.publishers else len(applied))
        ledger = self.scheduler.ledger
        ledger.write("resumed", "-", 0, step=resume["step"])
        for bid, n in sorted(net.items()):
            if n > 0 and bid not in applied:
                ledger.write("rolled_back", bid, 0, reason="consumed after the last checkpoint")
        self.pending_tickets.extend(self.scheduler.reissue_in_flight(reason="resume"))
        self.last_checkpoint = resume

    # ------------------------------------------------------------------------------------------
    def address(self, node: str, replica: int, port: str) -> str:
        return f"ipc://{self.sockdir}/{node}.{replica}.{port}"

    def build_procs(self) -> None:
        spec = self.spec
        self.master_ports: dict[tuple, int] = {}
        graph_file = str(self.run_dir / "graph.yaml")
        for entry in self.plan.entries:
            cls = self.classes[entry.node]
            node = spec.nodes[entry.node]
            inputs = {p: self.address(entry.node, entry.replica, p) for p in cls.inputs}
            outputs = []
            for e in spec.edges:
                if e.src == entry.node:
                    replicas = spec.nodes[e.dst].replicas
                    outputs.append(OutputRoute(edge=str(e), port=e.src_port,
                                               addresses=[self.address(e.dst, r, e.dst_port) for r in range(replicas)],
                                               capacity=e.capacity, capacity_bytes=e.capacity_bytes))
            group = (entry.node, entry.replica)
            if group not in self.master_ports:
                self.master_ports[group] = free_port()
            env = dict(self.plan.env_for(entry, master_port=self.master_ports[group]))
            ps = ProcSpec(node=entry.node, kind=node.kind, replica=entry.replica, replicas=node.replicas,
                          rank=entry.rank, world_size=entry.world_size, incarnation=0, run_dir=str(self.run_dir),
                          graph_file=graph_file, control=self.control_addr, inputs=inputs, outputs=outputs, env=env,
                          device_type=entry.device_type, devices=list(entry.devices),
                          cpu_cores=list(entry.local_devices) if entry.device_type == "cpu" else [],
                          is_sink=entry.node in self.sinks, is_source=entry.node in self.sources,
                          faults=self.faults, heartbeat_s=spec.supervision.heartbeat_s)
            if self.resume:
                ps.resume_from = self.checkpoint_file(self.resume, ps.proc_id)
                ps.start_index = self.resume["consumed"]
            self.procs.add(Proc(spec=ps))

    # process lifetime --------------------------------------------------------------------------
    def launch(self, proc: Proc) -> None:
        path = self.run_dir / "procs" / f"{proc.spec.log_name}.json"
        proc.spec.write(path)
        proc.ready = proc.wired = False
        proc.error = None
        proc.handle = self.launcher.start(path, self.run_dir / "logs" / f"{proc.spec.log_name}.log")
        proc.pid = proc.handle.pid
        proc.started_at = proc.last_seen = time.monotonic()
        proc.down_since = None
        if self.hub:
            self.hub.set("node_up", 0, node=proc.spec.node, replica=str(proc.spec.replica), across="min")
        log.info("started %s pid %s (incarnation %d)", proc.id, proc.pid, proc.spec.incarnation)

    async def send(self, proc: Proc, msg: dict) -> bool:
        try:
            await self.router.send_multipart([proc.identity, control.pack(msg)])
            return True
        except zmq.ZMQError:  # not connected (yet, or any more): the caller retries or replays
            return False

    def fail(self, proc: Proc | None, why: str) -> None:
        if self.failure:
            return
        if proc is not None:
            detail = f"\n  last error: {proc.error}" if proc.error else ""
            why = (f"node {proc.spec.node!r} replica {proc.spec.replica} rank {proc.spec.rank} "
                   f"(pid {proc.pid}) {why}{detail}\n  last log lines ({self.run_dir / 'logs' / (proc.spec.log_name + '.log')}):\n"
                   + "\n".join("    " + line for line in proc.log_tail(self.run_dir).splitlines()))
        self.failure = why
        log.error("run failed: %s", why)

    async def on_down(self, proc: Proc, why: str) -> None:
        """A process died, hung or failed: apply its node's failure policy."""
        if proc.handle and proc.handle.poll() is None:
            proc.handle.stop(0.5)  # hung: make sure it is gone before a replacement binds its address
        exit_text = describe_exit(proc.handle.poll() if proc.handle else None)
        proc.ready = proc.wired = False
        proc.down_since = time.monotonic()
        if self.hub:
            self.hub.set("node_up", 0, node=proc.spec.node, replica=str(proc.spec.replica), across="min")
        policy = self.spec.nodes[proc.spec.node].on_failure
        if policy.policy == "fail":
            self.fail(proc, f"{why} ({exit_text}); its failure policy is `fail`")
            return
        if proc.restarts >= policy.max_restarts:
            self.fail(proc, f"{why} ({exit_text}) and has used its restart budget of {policy.max_restarts}; "
                            f"raise nodes.{proc.spec.node}.on_failure.max_restarts or fix the node")
            return
        proc.restarts += 1
        proc.restart_at = time.monotonic() + policy.backoff_s * (2 ** (proc.restarts - 1))
        log.warning("%s %s (%s); restart %d/%d", proc.id, why, exit_text, proc.restarts, policy.max_restarts)
        if self.hub:
            self.hub.inc("restarts", node=proc.spec.node, replica=str(proc.spec.replica))
            self.hub.event("restart", node=proc.id, why=why)
        self.scheduler.ledger.write("node_down", "-", proc.spec.incarnation, node=proc.id, why=why)

    def restart(self, proc: Proc) -> None:
        proc.restart_at = None
        proc.spec.incarnation += 1
        if proc.spec.node in self.stateful:
            proc.spec.resume_from = self.checkpoint_file(self.last_checkpoint, proc.id)
            if proc.spec.node in self.sinks:
                applied = set(self.last_checkpoint["applied"]) if self.last_checkpoint else set()
                lost = [b for b, s in self.scheduler.tickets.items() if s.consumed and b not in applied]
                self.scheduler.rolled_back(lost, reason=f"{proc.id} restored from checkpoint")
                proc.spec.start_index = self.last_checkpoint["consumed"] if self.last_checkpoint else 0
                if proc.spec.node in self.publishers:
                    self.scheduler.version = self.last_checkpoint["version"] if self.last_checkpoint else 0
        self.launch(proc)

    # messages --------------------------------------------------------------------------------
    async def on_message(self, proc: Proc, msg: dict) -> None:
        t = msg["t"]
        self.procs.seen(proc)
        if t in ("hb", "consumed") and msg.get("metrics") and self.hub:
            try:
                self.hub.ingest(msg["metrics"])
            except Exception as e:  # noqa: BLE001 - a bad snapshot is dropped, the run goes on
                log.warning("dropped a metrics snapshot from %s: %s", proc.id, e)
        if t == "ready":
            proc.ready = True
            proc.pid = msg.get("pid", proc.pid)
            proc.store_port = msg.get("store_port")
            if self.hub:
                self.hub.set("node_up", 1, node=proc.spec.node, replica=str(proc.spec.replica), across="min")
            await self.after_ready(proc)
        elif t == "wired":
            proc.wired = True
            await self.after_wired(proc)
        elif t == "consumed":
            done = self.scheduler.consumed(proc.spec.node, msg["batch_id"], msg["attempt"],
                                           policy_version=msg.get("policy_version"), staleness=msg.get("staleness"))
            if done:
                await self.on_step(msg)
        elif t == "published":
            if "digest" in msg:
                self.scheduler.ledger.write("weights", "-", 0, node=proc.id, version=msg["version"], digest=msg["digest"])
            self.scheduler.set_version(msg["version"])
            await self.order_sync(msg["version"])
        elif t == "synced":
            proc.version = msg["version"]
            if "digest" in msg:
                self.scheduler.ledger.write("weights", "-", 0, node=proc.id, version=msg["version"], digest=msg["digest"])
        elif t == "sync_failed":
            log.warning("weight sync failed at %s: %s", proc.id, msg.get("error"))
            if msg.get("epoch") == self.epoch:
                await self.new_epoch()
        elif t == "checkpointed":
            self.checkpoints.setdefault(msg["step"], {})[proc.id] = msg["applied"]
            if proc.spec.node in self.publishers:
                self.checkpoint_versions[msg["step"]] = msg.get("version", 0)
            self.maybe_commit_checkpoint(msg["step"])
        elif t == "dropped":
            self.scheduler.ledger.write("duplicate_dropped", msg["batch_id"], msg["attempt"], node=proc.id,
                                        why=msg.get("why"))
        elif t == "error":
            proc.error = f"{msg.get('where')}: {msg.get('message')}"
            if msg.get("where") == "setup":
                proc.error += "\n" + msg.get("traceback", "")[-2000:]

    async def after_ready(self, proc: Proc) -> None:
        """Wire outputs once every consumer can receive: all at the start, a restarted one at once."""
        if not self.started:  # start-up: wait for all (a replica restarted meanwhile counts once ready)
            if all(p.ready for p in self.procs):
                self.started = True
                for p in self.procs:
                    await self.send(p, {"t": "wire"})
            return
        await self.send(proc, {"t": "wire"})

    async def after_wired(self, proc: Proc) -> None:
        first_start = proc.spec.incarnation == 0
        if proc.spec.node in self.publishers or proc.spec.node in self.subscribers:
            if all(p.ready and p.wired for p in self.weight_procs()):
                await self.new_epoch()
        if not first_start:
            for ticket in self.scheduler.reissue_in_flight(reason=f"{proc.id} restarted"):
                self.pending_tickets.append(ticket)
        await self.flush_tickets()

    def weight_procs(self) -> list[Proc]:
        return [p for p in self.procs if p.spec.rank == 0 and (p.spec.node in self.publishers or p.spec.node in self.subscribers)]

    async def new_epoch(self) -> None:
        """Form a fresh weight-sync group of every live member and send the newest weights."""
        members = [p for p in self.weight_procs() if p.ready and p.wired]
        pubs = [p for p in members if p.spec.node in self.publishers]
        if not pubs or len(members) < 2:
            self.epoch_members = []
            return
        self.epoch += 1
        self.epoch_members = pubs[:1] + [p for p in members if p.spec.node in self.subscribers]
        await self.order_sync(self.scheduler.version)

    async def order_sync(self, version: int) -> None:
        if not self.epoch_members:
            return
        pub = self.epoch_members[0]
        for rank, p in enumerate(self.epoch_members):
            await self.send(p, {"t": "sync", "epoch": self.epoch, "version": version, "rank": rank,
                                "world_size": len(self.epoch_members), "store": ["127.0.0.1", pub.store_port],
                                "timeout_s": max(30.0, self.spec.supervision.deadline_s * 4)})

    async def on_step(self, msg: dict) -> None:
        sched = self.scheduler
        if not self.publishers:
            sched.set_version(sched.consumed_count)
        now = time.monotonic()
        if self.hub:
            self.hub.end_step(step=sched.consumed_count, policy_version=sched.version,
                              extra={"staleness_max": msg.get("staleness", 0)})
        self.step_t = now
        if self.hub:
            from flowrl.metrics import write_status

            write_status(self.run_dir, self.hub.live_state(), phase="running", graph=self.summary)
        every = self.spec.schedule.checkpoint_every
        if self.stateful and every and sched.consumed_count % every == 0 and not sched.done:
            await self.order_checkpoint(sched.consumed_count)
        await self.flush_tickets()

    # checkpoints ----------------------------------------------------------------------------
    def checkpoint_file(self, record: dict | None, proc_id: str) -> str | None:
        name = (record or {}).get("files", {}).get(proc_id)
        return str((self.run_dir / "checkpoints" / name).resolve()) if name else None

    async def order_checkpoint(self, step: int) -> None:
        self.checkpoints[step] = {}
        self.checkpoint_state = getattr(self, "checkpoint_state", {})
        self.checkpoint_state[step] = {"scheduler": self.scheduler.state_dict(), "version": self.scheduler.version}
        for p in self.procs:
            if p.spec.node in self.stateful and p.ready:
                path = self.run_dir / "checkpoints" / f"{p.spec.log_name}.step{step:06d}.pt"
                await self.send(p, {"t": "checkpoint", "step": step, "path": str(path)})

    def maybe_commit_checkpoint(self, step: int) -> None:
        want = {p.id for p in self.procs if p.spec.node in self.stateful}
        got = self.checkpoints.get(step, {})
        if set(got) != want or step not in getattr(self, "checkpoint_state", {}):
            return
        sink_ids = [pid for pid in got if pid.split("/")[0] in self.sinks]
        applied = sorted(set().union(*(got[s] for s in sink_ids))) if sink_ids else []
        record = {**self.checkpoint_state.pop(step), "step": step, "applied": applied, "consumed": len(applied),
                  # the publisher's own version: it may have published more after the order went out
                  **({"version": self.checkpoint_versions.pop(step)} if step in self.checkpoint_versions else {}),
                  # names relative to RUN_DIR/checkpoints, so a moved run directory still resumes
                  "files": {pid: f"{pid.replace('/', '.')}.step{step:06d}.pt" for pid in got}}
        path = self.run_dir / "checkpoints" / "latest.json"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.last_checkpoint = record
        self.checkpoints.pop(step, None)
        log.info("checkpoint %d committed", step)

    # tickets --------------------------------------------------------------------------------
    async def flush_tickets(self) -> None:
        self.pending_tickets.extend(self.scheduler.issuable())
        self.pending_tickets.extend(self.scheduler.timed_out())
        keep = []
        for ticket in self.pending_tickets:
            sent = False
            for node in self.sources:
                procs = [p for p in self.procs.of_node(node) if p.ready and p.wired and p.spec.rank == 0]
                if not procs:
                    continue
                p = procs[self.source_rr % len(procs)]
                self.source_rr += 1
                sent = await self.send(p, {"t": "ticket", "batch_id": ticket.batch_id, "index": ticket.index,
                                           "attempt": ticket.attempt, "min_policy_version": ticket.min_policy_version,
                                           "size": ticket.size})
            if not sent:
                keep.append(ticket)
        self.pending_tickets = keep

    # supervision ------------------------------------------------------------------------------
    async def supervise(self) -> None:
        sup = self.spec.supervision
        now = time.monotonic()
        for proc in self.procs:
            if proc.restart_at is not None:
                if now >= proc.restart_at:
                    self.restart(proc)
                continue
            if proc.down_since is not None or proc.handle is None:
                continue
            code = proc.handle.poll()
            if code is not None:
                why = "failed in setup" if proc.error and proc.error.startswith("setup") else "exited"
                await self.on_down(proc, why)
            elif not proc.ready and now - proc.started_at > sup.startup_timeout_s:
                await self.on_down(proc, f"did not report READY within {sup.startup_timeout_s:.0f} s")
            elif proc.ready and now - proc.last_seen > sup.deadline_s:
                await self.on_down(proc, f"missed heartbeats for {now - proc.last_seen:.1f} s (deadline {sup.deadline_s} s): hung")

    async def receive_loop(self) -> None:
        while True:
            identity, data = await self.router.recv_multipart()
            proc, current = self.procs.by_identity(identity)
            if proc is None or not current:
                continue  # an old incarnation's last words
            try:
                msg = control.unpack(data)
            except Exception as e:  # noqa: BLE001
                log.warning("bad control message from %s: %s", proc.id, e)
                continue
            await self.on_message(proc, msg)

    async def run(self) -> int:
        for proc in self.procs:
            self.launch(proc)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.receive_loop)
                tg.start_soon(self.watch_signals, tg.cancel_scope)
                await self.loop_until(lambda: self.scheduler.done)
                if not self.failure and self.stateful:  # final checkpoint: a finished run can be extended
                    step = self.scheduler.consumed_count
                    await self.order_checkpoint(step)
                    with anyio.move_on_after(60):
                        await self.loop_until(lambda: (self.last_checkpoint or {}).get("step") == step)
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
                await self.send(proc, {"t": "stop"})
        deadline = time.monotonic() + self.spec.supervision.stop_timeout_s
        while any(p.alive for p in self.procs) and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        for proc in self.procs:
            if proc.handle:
                proc.handle.stop(1.0)
        self.scheduler.ledger.close()
        self.router.close(linger=0)
        self.zctx.term()
        shutil.rmtree(self.sockdir, ignore_errors=True)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.handle:
                proc.handle.signal(signal.SIGKILL)


def free_port() -> int:
    """A free TCP port on loopback for a node's own torch.distributed group (MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
