"""A node process: binds its inputs, reports READY, then feeds work through its node until stopped.

    python -m flowrl.runtime.worker RUN_DIR/procs/rollout.0.0.json

Order of start-up matters: devices are fixed (affinity / CUDA_VISIBLE_DEVICES) before anything
can touch CUDA, the node's `setup` runs and its input channels are bound before READY is reported,
so the controller only relies on a process that can already receive.

One event loop, one consumer: batches from every input, tickets and control orders are put on one
queue and handled in order, so weight swaps, checkpoints and rollbacks always fall between two
calls into the node. The node's own code (every hook) runs on the process's compute thread
(`compute.py`), never on the event loop's: while a hook computes, the loop goes on serving
channels (frames, credit, acks), control orders, metrics and dump requests. What to do with each arrival is decided by the input policies of the node's
shape (`inputs.py`): fence (recovery epochs), version gate (subscribers), join buffer, in-order
delivery with an output cache (stateful nodes), and once-only consumption (sinks).

The worker's work is split by responsibility into mixins of `Worker`; this module keeps start-up
(devices, setup, READY, wiring), the loops that fill and drain the event queue, and the lifetime:

    DataPath      an arrival through the input policies to the node and out (datapath.py)
    OrderTaker    the controller's orders: tickets, epochs, progress, rewiring, stop (orders.py)
    NodeState     checkpoint save/load, weight snapshots and weight sync (nodestate.py)
    RankMember    data parallelism: the leader's fan-out and gather, a follower's shards (ranks.py)
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.addresses import apply_control_client, input_security, output_curve
from flowrl.runtime.worker.compute import ComputeThread
from flowrl.runtime.worker.faults import FaultInjector
from flowrl.runtime.worker.inputs import Fence, JoinBuffer, Ordered, OutputCache, SinkSeen, VersionGate
from flowrl.runtime.worker.datapath import DataPath
from flowrl.runtime.worker.heartbeat import Heartbeat
from flowrl.runtime.worker.nodestate import NodeState
from flowrl.runtime.worker.orders import OrderTaker
from flowrl.runtime.protocol.procspec import ProcSpec
from flowrl.runtime.worker.ranks import SHARD, RankMember

log = logging.getLogger("flowrl.worker")


def bind_devices(spec: ProcSpec) -> None:
    """Fix this process's devices before torch (or CUDA) is used. Under Ray, a process with GPUs
    uses the GPUs Ray assigned its actor (Ray accounts for them cluster-wide) in place of the plan's
    physical ids; the logical ids (`cuda:0..n-1`) are the same, the plan's ids stay in
    `FLOWRL_PLAN_CUDA_VISIBLE_DEVICES`."""
    os.environ.update(spec.env)
    assigned = os.environ.pop("FLOWRL_RAY_CUDA_VISIBLE_DEVICES", None)
    if assigned is not None and spec.device_type == "cuda":
        ids = [i for i in assigned.split(",") if i.strip()]
        if len(ids) != len(spec.devices):
            raise RuntimeError(f"{spec.proc_id}: Ray assigned GPUs {assigned!r} to this process's actor but the plan "
                               f"gives it {len(spec.devices)} ({spec.devices}); the actor must ask Ray for num_gpus="
                               f"{len(spec.devices)}")
        os.environ["FLOWRL_PLAN_CUDA_VISIBLE_DEVICES"] = spec.env.get("CUDA_VISIBLE_DEVICES", "")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    if spec.device_type == "cpu" and spec.cpu_cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec.cpu_cores)


class Worker(DataPath, OrderTaker, NodeState, RankMember):
    def __init__(self, spec: ProcSpec):
        self.spec = spec
        self.ctx = zmq.asyncio.Context()
        self.ctl = self.ctx.socket(zmq.DEALER)
        self.ctl.setsockopt(zmq.IDENTITY, f"{spec.proc_id}#{spec.incarnation}".encode())
        self.ctl.setsockopt(zmq.LINGER, 2000)
        apply_control_client(self.ctl, spec.curve_public, spec.curve_secret, spec.control_key)
        self.ctl.connect(spec.control)
        self.receivers: dict = {}
        self.senders: list = []  # (route, Sender)
        self.events_tx, self.events_rx = anyio.create_memory_object_stream(float("inf"))
        self.faults = FaultInjector(spec.faults, spec.node, spec.replica, spec.rank)
        self.compute = ComputeThread(spec.log_name)  # where every hook of the node runs
        self.fence = Fence(spec.epoch)
        self.gate = VersionGate()
        self.stopping = False
        self.version = 0
        self.busy: tuple[str, float] | None = None  # read by the heartbeat thread
        self.step = 0
        self.wired = False
        self.t_start = time.monotonic()
        self.last_metrics = 0.0
        self.input_labels: dict[str, str] = {}
        self.output_labels: dict[str, str] = {}
        # A consumer that dies is restarted by the controller; until then senders wait rather
        # than fail (the supervision deadline, not the channel, decides when a node is lost).
        self.peer_timeout_s = spec.peer_timeout_s
        # every data channel of the run proves this (a stray local process cannot join a link)
        self.channel_secret = spec.secret.encode() if spec.secret else None

    async def send_ctl(self, msg) -> None:
        await self.ctl.send(m.encode(msg, self.spec.secret))

    # start-up -------------------------------------------------------------------------------
    async def setup(self) -> None:
        import torch

        from flowrl.graph import load_graph
        from flowrl.graph.kinds import resolve_kind
        from flowrl.graph.shapes import is_join, is_observer, is_sink, is_source
        from flowrl.metrics import Recorder
        from flowrl.node import NodeContext
        from flowrl.runtime.worker.weightsync import WeightsClient
        from flowrl.transport import ChannelConfig, Receiver

        spec = self.spec
        if spec.device_type == "cpu":
            torch.set_num_threads(max(1, len(spec.cpu_cores) or 1))
        graph = load_graph(spec.graph_file, check=False)
        self.graph = graph
        node_spec = graph.nodes[spec.node]
        cls = resolve_kind(node_spec.kind)
        self.cls = cls
        self.config = cls.Config.model_validate(node_spec.config)
        device = "cpu" if spec.device_type == "cpu" else "cuda:0"
        if spec.device_type == "cuda":
            torch.cuda.set_device(0)
            await self.compute.call(torch.cuda.set_device, 0)  # the current device is per thread
        self.recorder = Recorder(node=spec.node, replica=spec.replica)
        self.nctx = NodeContext(
            name=spec.node, kind=node_spec.kind, replica=spec.replica, replicas=spec.replicas,
            seed=graph.seed, device=device, devices=spec.devices, dtype=node_spec.dtype,
            rank=spec.rank, world_size=spec.world_size, run_dir=Path(spec.run_dir), graph=graph,
            recorder=self.recorder, log=logging.getLogger(f"flowrl.node.{spec.node}"),
        )
        # the node's shape decides its input policies
        self.is_source, self.is_observer, self.is_sink = is_source(cls), is_observer(cls), is_sink(cls)
        self.is_join = is_join(cls)
        self.stateful = cls.stateful
        self.ordered = Ordered(spec.watermark) if self.stateful else None
        self.cache = OutputCache() if self.stateful and not self.is_sink else None
        self.joins = JoinBuffer(cls.inputs) if self.is_join else None
        self.seen = SinkSeen(spec.watermark, spec.consumed) if self.is_sink and not self.stateful else None
        sched = graph.schedule
        self.checkpoint_every, self.steps = sched.checkpoint_every, spec.steps or sched.steps
        self.saved_at = (-1, -1)  # (epoch, step) of the last checkpoint saved
        if spec.world_size > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if spec.device_type == "cuda" else "gloo",
                                    rank=spec.rank, world_size=spec.world_size)
        if spec.incarnation == 0 or any(f.every for f in self.faults.faults):
            self.faults.check_setup()
        await self.new_node()
        if spec.resume_from:
            await self.load_checkpoint(spec.resume_from)
        self.weights = None
        if (cls.publishes_weights and spec.rank == 0) or cls.subscribes_weights:  # a trainer's rank 0 publishes
            self.weights = WeightsClient(self.node, publisher=cls.publishes_weights, device=device,
                                         recorder=self.recorder, faults=self.faults, secret=spec.secret,
                                         serving_dtype=spec.serving_dtype, host=spec.host_address,
                                         ready_timeout_s=graph.supervision.process_timeout_s)
        if cls.subscribes_weights and spec.epoch > 0:
            self.version = -1  # after a rollback only the publisher's restored weights count
        self.input_labels, self.output_labels = edge_labels(graph, spec.node)
        self.dp = spec.world_size > 1
        self.rank_rx = None
        self.rank_tx: dict[int, object] = {}
        self.rank_replies: dict[tuple, object] = {}  # the leader's follower replies not yet gathered
        self.restore_orders: dict = {}  # epoch -> its Epoch order, restored when the leader says so
        self.accepted = None  # a follower's (shard, step) accepted, waiting for the leader's verdict
        self.sync_orders: dict = {}  # a data-parallel subscriber's follower: Sync orders by sync epoch
        self.awaiting_sync = None  # ... the sync epoch its leader's step named before the order came
        self.deferred_restore = None  # a leader's rollback step ordered before it was wired
        self.markers = 0  # steps the leader sent its followers that belong to no ticket
        if self.dp:
            if self.is_source or self.is_join or len(cls.outputs) > 1:
                raise ValueError(f"node {spec.node!r}: data parallelism (devices: {spec.world_size}) splits each batch "
                                 "over the ranks of a transform or sink with one output port; for a source, a join "
                                 "or several outputs use replicas instead")
            self.rank_rx = Receiver(ChannelConfig(capacity_messages=4, peer_timeout_s=self.peer_timeout_s, secret=self.channel_secret),
                                    name=f"{spec.node}.rank{spec.rank}", task_group=self.channel_tg)
            await self.rank_rx.bind(spec.rank_addresses[spec.rank])
        if spec.rank == 0:
            for port, address in spec.inputs.items():
                route_caps = [o for o in graph.edges if o.dst == spec.node and o.dst_port in (None, port)]
                cap = min((e.capacity for e in route_caps), default=4)
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

    async def new_node(self) -> None:
        """The node as right after setup (at start, and on a rollback with nothing committed)."""
        self.node = await self.compute.call(self.cls, self.config, self.nctx)
        await self.compute.call(self.node.setup)
        if getattr(self, "weights", None) is not None:  # a rollback: the weights are the new node's
            self.weights.rebind(self.node)

    def output_curve(self, key: str | None):
        return output_curve(self.spec, key)

    async def wire(self, routes: dict | None = None) -> None:
        """Connect our outputs (the controller says so once every consumer reported READY, with
        the addresses they bound), then start taking input: nothing is processed before its
        results have somewhere to go."""
        from flowrl.transport import ChannelConfig, Sender

        if self.wired:
            return
        for route in self.spec.outputs:
            if routes and route.edge in routes:
                route.addresses = [a for a, _ in routes[route.edge]]
                route.keys = {a: k for a, k in routes[route.edge] if k}
            cfg = ChannelConfig(capacity_messages=route.capacity, capacity_bytes=route.capacity_bytes,
                                peer_timeout_s=self.peer_timeout_s, secret=self.channel_secret, allow_remote=True)
            tx = Sender(cfg, name=route.edge.split("->")[1].strip(), task_group=self.channel_tg)  # channels are named by their consumer port
            for address in route.addresses:
                await tx.connect(address, curve=self.output_curve(route.keys.get(address)))
            self.senders.append((route, tx))
        self.wired = True
        log.info("wired %.2f s after start", time.monotonic() - self.t_start)
        if self.dp:  # the leader sends shards to every follower; followers send results back to it
            peers = range(1, self.spec.world_size) if self.spec.rank == 0 else [0]
            for r in peers:
                tx = Sender(ChannelConfig(capacity_messages=4, peer_timeout_s=self.peer_timeout_s, secret=self.channel_secret), name=f"rank{r}", task_group=self.channel_tg)
                await tx.connect(self.spec.rank_addresses[r])
                self.rank_tx[r] = tx
            if self.spec.rank > 0:
                self.tg.start_soon(self.input_loop, SHARD, self.rank_rx)
            if self.deferred_restore is not None:  # a rollback ordered before we could reach the followers
                (step, epoch), self.deferred_restore = self.deferred_restore, None
                if await self.lead(None, step, epoch=epoch):
                    await self.follow(step, epoch=epoch)
        for port, rx in self.receivers.items():
            self.tg.start_soon(self.input_loop, port, rx)
        await self.send_ctl(m.Wired(epoch=self.fence.epoch))

    # loops ----------------------------------------------------------------------------------
    async def control_loop(self) -> None:
        while True:
            data = await self.ctl.recv()
            try:
                msg = m.decode(data)
            except m.ControlError as e:
                log.warning("dropped bad control message: %s", e)
                continue
            if isinstance(msg, m.Sync) and self.weights is not None:
                self.weights.fence(msg.sync_epoch)  # a member died: stop waiting for the old epoch
            await self.events_tx.send(("ctl", msg))

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
            await self.events_tx.send(("data", port, batch, rx))

    async def metrics_loop(self) -> None:
        """Metrics ride on heartbeats from the event loop; liveness comes from `Heartbeat` (a thread)."""
        while True:
            self.recorder.sample_process()
            for port, rx in self.receivers.items():
                stats = rx.statistics()
                self.recorder.gauge("queue_depth", stats.queued, across="sum", edge=self.input_labels[port])
                self.recorder.gauge("channel_rejected", stats.rejected, across="sum", edge=self.input_labels[port])
                self.recorder.gauge("channel_shm_bytes", stats.shm_bytes, across="sum", edge=self.input_labels[port])
            await self.send_metrics()
            await anyio.sleep(max(self.spec.heartbeat_s, 0.5))

    async def send_metrics(self) -> None:
        self.last_metrics = time.monotonic()
        await self.send_ctl(m.Heartbeat(metrics=self.recorder.drain()))

    async def main_loop(self) -> None:
        while True:
            with self.recorder.span("wait_input"):  # idle: nothing to do until an event arrives
                try:
                    event = await self.events_rx.receive()
                except anyio.EndOfStream:
                    return
            if event[0] == "ctl":
                await self.on_control(event[1])
            else:
                await self.on_arrival(event[1:])
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
        if self.cls.publishes_weights:
            await self.publish_snapshot()  # version 0 (or the checkpoint's), before anything can ask for it
        store_port = self.weights.store_port if self.weights is not None else None
        await self.send_ctl(m.Ready(pid=os.getpid(), store_port=store_port,
                                    inputs={port: rx.address for port, rx in self.receivers.items()}))
        self.faults.arm(self.spec.incarnation)
        self.watch_dump_signal()
        try:
            async with anyio.create_task_group() as tg:
                self.tg = tg
                tg.start_soon(self.control_loop)
                tg.start_soon(self.metrics_loop)
                tg.start_soon(self.faults.timer_loop)
                if self.stateful and not self.spec.resume_from:
                    await self.save_checkpoint(self.spec.watermark)  # the state every rollback can reach
                await self.main_loop()
                tg.cancel_scope.cancel()
            with anyio.move_on_after(5):
                await self.compute.call(self.node.teardown)
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            await self.report_error("process", e)
            return 4
        finally:
            with anyio.CancelScope(shield=True):
                for _, tx in self.senders:
                    with anyio.move_on_after(1):
                        await tx.aclose()
                for tx in self.rank_tx.values():
                    with anyio.move_on_after(1):
                        await tx.aclose()
                for rx in [*self.receivers.values(), *([self.rank_rx] if self.rank_rx else [])]:
                    with anyio.move_on_after(1):
                        await rx.aclose()
            self.compute.close(timeout=1.0)
        return 0

    def watch_dump_signal(self) -> None:
        """SIGUSR1 (`flowrl status RUN_DIR --dump`, or `kill -USR1 PID`) writes what this process waits on into
        its log: every task's stack, every channel's counters, the input policies' queues."""
        import asyncio
        import signal

        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: log.warning("%s", self.dump_state()))

    def dump_state(self) -> str:
        import asyncio
        import io

        out = io.StringIO()
        busy = f"{self.busy[0]} for {time.monotonic() - self.busy[1]:.1f}s" if self.busy else "no"
        print(f"state dump of {self.spec.proc_id} (incarnation {self.spec.incarnation}): epoch {self.fence.epoch}, "
              f"version {self.version}, step {self.step}, busy {busy}, stopping {self.stopping}", file=out)
        print(f"  compute thread: {self.compute.where()}", file=out)
        if self.accepted is not None:
            print(f"  accepted, waiting for the leader's verdict: {self.accepted[0].batch_id} {self.accepted[1]}", file=out)
        if self.ordered is not None:
            print(f"  in order: watermark {self.ordered.watermark}, buffered {sorted(self.ordered.buffer)[:8]}", file=out)
        print(f"  held for weights: {[a[1].batch_id for a in self.gate.waiting][:8]}; "
              f"future epochs: {len(self.fence.future)}", file=out)
        if self.joins is not None:
            print(f"  join parts: { {b: (a, i, sorted(ps)) for b, (a, i, ps) in list(self.joins.parts.items())[:8]} }", file=out)
        channels = [*self.receivers.values(), *([self.rank_rx] if self.rank_rx else []),
                    *(tx for _, tx in self.senders), *self.rank_tx.values()]
        for ch in channels:
            print(f"  channel {ch.statistics()}", file=out)
        for task in asyncio.all_tasks():
            print(f"  task {task.get_name()}: {await_chain(task.get_coro())}", file=out)
        return out.getvalue()

    async def report_error(self, where: str, e: BaseException) -> None:
        from flowrl.runtime.worker.contract import describe_error

        info = describe_error(e)
        batch_id = getattr(self, "failed_on", None) or (self.busy[0] if self.busy else None)
        log.error("%s failed: %s: %s\n%s", where, info["type"], info["message"], info["traceback"])
        with anyio.move_on_after(2):
            await self.send_ctl(m.Error(where=where, type=info["type"], message=info["message"], file=info["file"],
                                        line=info["line"], batch_id=batch_id, traceback=info["traceback"]))



def edge_labels(graph, node: str) -> tuple[dict[str, str], dict[str, str]]:
    """Metric labels of this node's edges: `src->dst` (ports only where two edges would collide).
    Returns ({input port: label}, {edge string: label})."""
    def short(e):
        return f"{e.src}->{e.dst}"

    counts: dict[str, int] = {}
    for e in graph.edges:
        counts[short(e)] = counts.get(short(e), 0) + 1
    label = {str(e): short(e) if counts[short(e)] == 1 else str(e).replace(" ", "") for e in graph.edges}
    inputs: dict[str, str] = {}
    for e in graph.edges:
        if e.dst == node:
            port = e.dst_port or "in"
            inputs[port] = label[str(e)] if port not in inputs else f"{node}.{port}"
    outputs = {str(e): label[str(e)] for e in graph.edges if e.src == node}
    return inputs, outputs


def await_chain(coro) -> str:
    """Where a coroutine waits: each coroutine it awaits, innermost last, then what that one awaits."""
    steps = []
    for _ in range(64):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        steps.append(f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})")
        nxt = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
        if nxt is None or not (hasattr(nxt, "cr_frame") or hasattr(nxt, "gi_frame") or hasattr(nxt, "ag_frame")):
            if nxt is not None:
                steps.append(f"waits on {type(nxt).__name__}")
            break
        coro = nxt
    return " -> ".join(steps) or repr(coro)


def pid_file(spec: ProcSpec) -> Path:
    """`procs/<process>.pid` in the run directory: what `flowrl status --dump` signals (on this host)."""
    return Path(spec.run_dir) / "procs" / f"{spec.log_name}.pid"


def write_pid_file(spec: ProcSpec) -> None:
    import json
    import socket

    with contextlib.suppress(OSError):  # a run directory this host cannot write (another host's)
        pid_file(spec).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "proc": spec.proc_id,
                                    "incarnation": spec.incarnation}))


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
    import signal

    # until the event loop answers it (after setup), a dump request must not end the process
    signal.signal(signal.SIGUSR1, lambda *_: log.warning("state dump of %s: still starting (setup)", spec.proc_id))
    write_pid_file(spec)
    heartbeat = Heartbeat(spec)
    worker = Worker(spec)
    heartbeat.worker = worker
    heartbeat.start()
    try:
        code = anyio.run(worker.run_with_channels)
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the loop's handler went with the loop
        worker.ctl.close(linger=1000)
        with contextlib.suppress(OSError):
            pid_file(spec).unlink()
    return code


if __name__ == "__main__":
    sys.exit(main())
