"""A node process: binds its inputs, reports READY, then feeds work through its node until stopped.

    python -m flowrl.runtime.worker RUN_DIR/procs/rollout.0.0.json

Order of start-up matters: devices are fixed (affinity / CUDA_VISIBLE_DEVICES) before anything can touch
CUDA, the node's `setup` runs and its inputs are bound before READY (the controller relies on it then).

One event loop, one consumer: batches from every input, tickets and control orders are put on one queue and
handled in order, so weight swaps, checkpoints and rollbacks fall between two calls into the node (with
`concurrency`, calls run as tasks and a weight swap between their steps). The node's own code (every hook)
runs on the process's compute thread (`compute.py`), never on the event loop's: while a hook computes, the
loop goes on serving channels (frames, credit, acks), control orders, metrics and dump requests. What to do
with each arrival is decided by the input policies of the node's shape (`inputs.py`): fence (recovery epochs),
version gate (subscribers), join buffer, in-order delivery with an output cache (stateful nodes), and
once-only consumption (sinks).

The work is done by components that each own their state and are given what they need (`startup.py` builds
and wires them); `Worker` keeps the control socket, the channels, the loops that fill and drain the event
queue (control orders go to a handler table keyed by their type), and the process's lifetime:

    WeightVersion  the process's policy version; keeps the node's `ctx.policy_version` equal (version.py)
    NodeRunner     the node instance and every call into it, `busy` for the heartbeat (runner.py)
    DataPath       an arrival through the input policies to the node and out (datapath.py)
    Outputs        stamping, sending on the output edges, a sink's consumption (outputs.py)
    OrderTaker     the controller's orders: tickets, epochs, progress (orders.py)
    NodeState      checkpoint save/load, weight snapshots (nodestate.py)
    WeightSyncs    weight-sync orders (syncs.py)
    RankGroup      data parallelism: the leader's fan-out and gather, a follower's shards (ranks.py)
    GroupSteps     what follows a ticket or a rollback on every rank, as the leader decided (steps.py)
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time

import anyio
import zmq

from flowrl.runtime.protocol import loops, messages as m
from flowrl.runtime.protocol.addresses import (admit_producers, connect_control, input_security, output_curve,
                                               rank_security)
from flowrl.runtime.protocol.procspec import ProcSpec
from flowrl.runtime.worker.compute import ComputeThread
from flowrl.runtime.worker.dump import state_dump
from flowrl.runtime.worker.events import Events
from flowrl.runtime.worker.faults import FaultInjector
from flowrl.runtime.worker.heartbeat import Heartbeat
from flowrl.runtime.worker.pidfile import pid_file, write_pid_file
from flowrl.runtime.worker.ranks import SHARD
from flowrl.runtime.worker.services import SERVE_PORT, ServiceEnds
from flowrl.runtime.worker.startup import Parts, bind_devices, build_parts  # noqa: F401 - bind_devices: tests import it here
from flowrl.transport.asyncsock import AsyncSocket

log = logging.getLogger("flowrl.worker")


class Worker:
    """One node process: wires the components (startup.py), owns the control socket, the event
    loop and the channels, and the process's lifetime."""

    def __init__(self, spec: ProcSpec):
        self.spec = spec
        self.ctl = AsyncSocket(connect_control(zmq.Context(), spec, linger_ms=2000))  # the socket keeps its context
        self.receivers: dict = {}
        self.rank_rx = None  # this rank's channel from its data-parallel peers
        self.events = Events()  # what the main loop takes: data, control messages, call errors
        self.faults = FaultInjector(spec.faults, spec.node, spec.replica, spec.rank)
        self.compute = ComputeThread(spec.log_name)  # where every hook of the node runs
        self.parts: Parts | None = None  # the components, once set up
        self.services = ServiceEnds(spec, self.faults)  # `services:` of the graph, as client or server
        self.stopping = False
        self.wired = False
        self.t_start = time.monotonic()
        self.last_metrics = 0.0

    @property
    def peer_timeout_s(self) -> float:
        """A consumer that dies is restarted by the controller; until then senders wait rather than
        fail (the supervision deadline, not the channel, decides when a node is lost)."""
        return self.spec.peer_timeout_s

    @property  # what every data channel of the run proves (a stray local process cannot join a link)
    def channel_secret(self) -> bytes | None:
        return self.spec.secret.encode() if self.spec.secret else None

    @property
    def busy(self) -> tuple[str, float] | None:
        """Which call into the node runs since when (read by the heartbeat thread)."""
        return self.parts.runner.busy if self.parts is not None else None

    async def send_ctl(self, msg) -> None:
        await self.ctl.send(m.encode(msg, self.spec.secret))

    # start-up -------------------------------------------------------------------------------
    async def setup(self) -> None:
        from flowrl.transport import ChannelConfig, Receiver

        spec = self.spec
        self.parts = await build_parts(spec, self.compute, self.faults, report=self.send_ctl, started=self.t_start,
                                       open_rank_channel=self.open_rank_channel, services=self.services.open_clients())
        self.services.attach(self.parts)
        graph = self.parts.graph
        if spec.rank == 0:
            for port, address in spec.inputs.items():
                if port == SERVE_PORT:
                    continue
                route_caps = [o for o in graph.edges if o.dst == spec.node and o.dst_port in (None, port)]
                cap = min((graph.edge_capacity(e) for e in route_caps), default=4)
                cap_bytes = min((e.capacity_bytes for e in route_caps), default=1 << 30)
                # no one link (a buggy or hostile producer) may hold all of the input's credit, nor
                # sit on what it holds for long: the others keep going
                rx = Receiver(ChannelConfig(capacity_messages=cap, capacity_bytes=cap_bytes,
                                            link_capacity_messages=max(1, cap // 2) if cap > 2 else None,
                                            credit_idle_s=2.0, peer_timeout_s=self.peer_timeout_s,
                                            secret=self.channel_secret, **input_security(spec, port, address)),
                              name=f"{spec.node}.{port}", task_group=self.channel_tg)
                await rx.bind(address)
                self.receivers[port] = rx

    async def open_rank_channel(self):
        """Bind this rank's channel from its data-parallel peers (shards, or the followers' replies)."""
        from flowrl.transport import ChannelConfig, Receiver

        spec, address = self.spec, self.spec.rank_addresses[self.spec.rank]
        self.rank_rx = Receiver(ChannelConfig(capacity_messages=4, peer_timeout_s=self.peer_timeout_s, secret=self.channel_secret,
                                              **rank_security(spec, address)), name=f"{spec.node}.rank{spec.rank}", task_group=self.channel_tg)
        await self.rank_rx.bind(address)
        return self.rank_rx

    async def wire(self, msg: m.Wire) -> None:
        """Connect our outputs (the controller says so once every consumer reported READY, with
        the addresses they bound), then start taking input: nothing is processed before its
        results have somewhere to go."""
        from flowrl.transport import ChannelConfig, Sender

        if self.wired:
            return
        routes, parts = msg.routes, self.parts
        for route in self.spec.outputs:
            if routes and route.edge in routes:
                route.addresses = [a for a, _ in routes[route.edge]]
                route.keys = {a: k for a, k in routes[route.edge] if k}
            cfg = ChannelConfig(capacity_messages=route.capacity, capacity_bytes=route.capacity_bytes,
                                peer_timeout_s=self.peer_timeout_s, secret=self.channel_secret, allow_remote=True)
            tx = Sender(cfg, name=route.edge.split("->")[1].strip(), task_group=self.channel_tg)  # channels are named by their consumer port
            for address in route.addresses:
                await tx.connect(address, curve=output_curve(self.spec, route.keys.get(address)))
            parts.outputs.add(route, tx)
        self.wired = True
        log.info("wired %.2f s after start", time.monotonic() - self.t_start)
        if parts.ranks is not None:  # the leader sends shards to every follower; followers send results back to it
            peers = range(1, self.spec.world_size) if self.spec.rank == 0 else [0]
            for r in peers:  # ipc on one host; tcp + CURVE (the peer's key) across hosts
                tx = Sender(ChannelConfig(capacity_messages=4, peer_timeout_s=self.peer_timeout_s, secret=self.channel_secret,
                                          allow_remote=True), name=f"rank{r}", task_group=self.channel_tg)
                await tx.connect(self.spec.rank_addresses[r], curve=output_curve(self.spec, self.spec.rank_keys[r]))
                parts.ranks.add_peer(r, tx)
            if self.spec.rank > 0:
                self.tg.start_soon(self.input_loop, SHARD, self.rank_rx)
            await parts.steps.wired()  # a rollback ordered before we could reach the followers
        await self.services.connect(routes)
        for port, rx in self.receivers.items():
            self.tg.start_soon(self.input_loop, port, rx)
        await self.send_ctl(m.Wired(epoch=parts.orders.epoch))

    async def rewire(self, msg: m.Connect | m.Disconnect | m.Admit) -> None:
        """A consumer replica added, moved or removed (data edge, service); Admit: producers' keys."""
        if isinstance(msg, m.Admit):  # producers of an input added or removed on other hosts
            return admit_producers(self.spec, self.receivers, msg)
        if not await self.services.rewire(msg):
            await self.parts.outputs.rewire(msg)

    async def stop(self, msg: m.Stop) -> None:
        self.stopping = True
        self.parts.syncs.stop()
    # loops ----------------------------------------------------------------------------------
    async def control_loop(self) -> None:
        while True:
            data = await self.ctl.recv()
            try:
                msg = m.decode(data)
            except m.ControlError as e:
                log.warning("dropped bad control message: %s", e)
                continue
            if self.parts.turns.arrived(msg) or self.parts.syncs.arrived(msg):
                continue  # a turn's grant or yield, and a trainer's sync orders, are served beside its calls
            if isinstance(msg, m.Connect) and self.wired:  # a moved consumer: a send blocked on its old
                await self.rewire(msg)  # address gets credit there (Connect never waits; Disconnect queues)
                continue
            self.events.put(("ctl", msg))

    async def input_loop(self, port: str, rx) -> None:
        from flowrl.transport import BrokenChannel, ChannelClosed, EndOfStream

        while True:
            try:
                batch = await rx.recv()
            except (ChannelClosed, EndOfStream) as e:
                # producers end their streams only when the run stops; an input that ends while the
                # node is still working would leave it waiting forever: fail, and be restarted
                with anyio.move_on_after(2.0):
                    while not self.stopping:
                        await anyio.sleep(0.1)
                if self.stopping:
                    return
                raise RuntimeError(f"input {port!r} ended while the run goes on ({type(e).__name__}: {e})") from e
            except BrokenChannel as e:  # every producer gone for a while: they are being restarted
                log.warning("input %s: %s; waiting for producers", port, e)
                continue
            self.events.put(("data", port, batch, rx))

    async def metrics_loop(self) -> None:
        """Metrics ride on heartbeats from the event loop; liveness comes from `Heartbeat` (a thread).
        What this samples goes out now only when the main loop sent nothing for half an interval:
        while data flows, the main loop's next send (within ~0.1 s) carries it, one message fewer."""
        recorder, labels = self.parts.recorder, self.parts.input_labels
        interval = max(self.spec.heartbeat_s, 0.5)
        while True:
            recorder.sample_process()
            recorder.sample_cpu()  # CPU per thread and category: `flowrl report`'s CPU per step
            for port, rx in self.receivers.items():
                stats = rx.statistics()
                recorder.gauge("queue_depth", stats.queued, across="sum", edge=labels[port])
                recorder.gauge("channel_rejected", stats.rejected, across="sum", edge=labels[port])
                recorder.gauge("channel_shm_bytes", stats.shm_bytes, across="sum", edge=labels[port])
            if time.monotonic() - self.last_metrics >= interval / 2:
                await self.send_metrics()
            await anyio.sleep(interval)

    async def send_metrics(self) -> None:
        self.last_metrics = time.monotonic()
        await self.send_ctl(m.Heartbeat(metrics=self.parts.recorder.drain()))

    async def main_loop(self) -> None:
        handlers, path = handler_table(self.parts, wire=self.wire, stop=self.stop, rewire=self.rewire), self.parts.path
        if path.calls is not None:  # `concurrency`: calls run as tasks; an error comes back here
            path.calls.bind(self.tg.start_soon, lambda e: self.events.put(("error", e)))
        while True:
            event = self.events.take_nowait()
            if event is None:
                with self.parts.recorder.span("wait_input"):  # idle: nothing to do until an event arrives
                    event = await self.events.take()
            if event[0] == "error":  # a call that ran beside others failed: the process fails
                raise event[1]
            elif event[0] == "ctl":
                handler = handlers.get(type(event[1]))
                if handler is not None:
                    await handler(event[1])
            else:
                await path.on_arrival(event[1:])
                if time.monotonic() - self.last_metrics > 0.1:  # metrics land in their own step's row
                    await self.send_metrics()
            if self.stopping:
                await self.send_metrics()  # what it recorded since the last heartbeat (the last spans)
                return

    # lifetime -------------------------------------------------------------------------------
    async def run_with_channels(self) -> int:
        """run_node inside the task group that runs every channel's background work (heartbeats,
        timers, re-sends): run_node closes the channels; a channel task that fails ends the process."""
        async with anyio.create_task_group() as self.channel_tg:
            code = await self.run_node()
            self.channel_tg.cancel_scope.cancel()  # channels left open (setup failed) stop with us
        return code

    async def run_node(self) -> int:
        try:
            await self.setup()
        except Exception as e:  # noqa: BLE001 - the controller shows this and fails fast
            await self.report_error("setup", e)
            return 3
        # what setup built (model, optimizer, imports) lives as long as the node: out of the cyclic
        # collector's way, whose full passes would otherwise walk it again and again
        gc.collect()  # garbage of the start-up goes now; frozen, it would stay
        gc.freeze()
        log.info("ready %.2f s after start (incarnation %d)", time.monotonic() - self.t_start, self.spec.incarnation)
        parts = self.parts
        if parts.shape.publishes:
            await parts.state.publish_snapshot()  # version 0 (or the checkpoint's), before anything can ask for it
        store_port = parts.weights.store_port if parts.weights is not None else None
        bound = {port: rx.address for port, rx in self.receivers.items()}
        await self.send_ctl(m.Ready(pid=os.getpid(), store_port=store_port, inputs={**bound, **self.services.bound()}))
        self.faults.arm(self.spec.incarnation)
        self.watch_dump_signal()
        try:
            async with anyio.create_task_group() as tg:
                self.tg = tg
                tg.start_soon(self.control_loop)
                tg.start_soon(self.metrics_loop)
                tg.start_soon(self.faults.timer_loop)
                if self.services.server is not None:
                    tg.start_soon(self.services.server.run)
                tg.start_soon(parts.turns.serve)  # colocated nodes that take turns: sleeps when asked
                if parts.syncs.beside:
                    tg.start_soon(parts.syncs.serve_lane)
                if parts.syncs.fetches is not None:
                    tg.start_soon(parts.syncs.fetches.run)
                if parts.shape.stateful and not self.spec.resume_from:
                    await parts.state.save(self.spec.watermark)  # the state every rollback can reach
                try:
                    await self.main_loop()
                finally:  # (also failing) a round still waiting ends soon: the task group waits for it
                    parts.syncs.stop()
                tg.cancel_scope.cancel()
            with anyio.move_on_after(5):
                await self.compute.call(parts.runner.node.teardown)
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            await self.report_error("process", e)
            return 4
        finally:
            with anyio.CancelScope(shield=True):
                self.services.close()
                for ch in self.channels():
                    with anyio.move_on_after(1):
                        await ch.aclose()
            self.compute.close(timeout=1.0)
        return 0

    def watch_dump_signal(self) -> None:
        """SIGUSR1 (`flowrl status RUN_DIR --dump`, or `kill -USR1 PID`) writes what this process waits on into
        its log: every task's stack, every channel's counters, the input policies' queues."""
        import asyncio
        import signal
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: log.warning("%s", self.dump_state()))

    def channels(self) -> list:
        """Every channel of this process: outputs first, then to the ranks, then inputs (closed in this order)."""
        parts = self.parts
        outs = parts.outputs.channels() if parts is not None else []
        ranks = parts.ranks.senders() if parts is not None and parts.ranks is not None else []
        return [*outs, *ranks, *self.receivers.values(), *([self.rank_rx] if self.rank_rx else [])]

    def dump_state(self) -> str:
        return state_dump(self)

    async def report_error(self, where: str, e: BaseException) -> None:
        from flowrl.runtime.worker.contract import describe_error

        info = describe_error(e)
        failed_on = self.parts.runner.failed_on if self.parts is not None else None
        batch_id = failed_on or (self.busy[0] if self.busy else None)
        log.error("%s failed: %s: %s\n%s", where, info["type"], info["message"], info["traceback"])
        with anyio.move_on_after(2):
            await self.send_ctl(m.Error(where=where, type=info["type"], message=info["message"], file=info["file"],
                                        line=info["line"], batch_id=batch_id, traceback=info["traceback"]))


def handler_table(parts: Parts, *, wire, stop, rewire) -> dict:
    """What each control order does, by its type: every `controller -> node` message has one (tested)."""
    return {m.TicketMsg: parts.orders.ticket, m.Sync: parts.syncs.order,
            m.Epoch: parts.syncs.apart_from(parts.orders.enter_epoch),  # a trainer serves no sync meanwhile
            m.Progress: parts.orders.progress, m.Wire: wire, m.Connect: rewire, m.Disconnect: rewire, m.Stop: stop,
            m.Admit: rewire, m.TurnGrant: parts.turns.order, m.TurnYield: parts.turns.order}  # (taken by the control loop first)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get("FLOWRL_SPEC_STDIN") == "1":  # the ray launcher: the spec (with keys) came in memory
        spec = ProcSpec.from_json(sys.stdin.read())
    else:
        spec = ProcSpec.read(argv[0])
    for entry in reversed([os.getcwd(), *spec.sys_path]):  # user node modules resolve as for the controller
        if entry not in sys.path:
            sys.path.insert(0, entry)
    bind_devices(spec)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.proc_id} %(levelname)s %(name)s: %(message)s",
                        force=True)
    # the first line of each incarnation: one that never gets as far as `ready` still shows it started
    log.info("started (incarnation %d, pid %d)", spec.incarnation, os.getpid())
    import faulthandler
    import signal

    # until the event loop answers it (after setup), a dump request must not end the process
    signal.signal(signal.SIGUSR1, lambda *_: log.warning("state dump of %s: still starting (setup)", spec.proc_id))
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # stacks, even from C: supervisor.last_words
    write_pid_file(spec)
    heartbeat = Heartbeat(spec)
    worker = Worker(spec)
    heartbeat.worker = worker
    heartbeat.start()
    try:
        code = anyio.run(worker.run_with_channels, backend_options=loops.run_options())
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the loop's handler went with the loop
        worker.ctl.close(linger=1000)
        with contextlib.suppress(OSError):
            pid_file(spec).unlink()
    return code


if __name__ == "__main__":
    sys.exit(main())
