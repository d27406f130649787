"""A node process: binds its inputs, reports READY, then feeds batches through its node until stopped.

    python -m flowrl.runtime.worker RUN_DIR/procs/rollout.0.0.json

Order of start-up matters: devices are fixed (affinity / CUDA_VISIBLE_DEVICES) before anything
can touch CUDA, the node's `setup` runs and its input channels are bound before READY is reported,
so the controller only relies on a process that can already receive.

One event loop, one consumer: batches from every input, tickets and control orders are put on one
queue and handled in order, so weight swaps and checkpoints always fall between two batches.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from flowrl.runtime import control
from flowrl.runtime.faults import FaultInjector
from flowrl.runtime.procspec import ProcSpec

log = logging.getLogger("flowrl.worker")


def bind_devices(spec: ProcSpec) -> None:
    """Fix this process's devices before torch (or CUDA) is used."""
    os.environ.update(spec.env)
    if spec.device_type == "cpu" and spec.cpu_cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec.cpu_cores)


class Worker:
    def __init__(self, spec: ProcSpec):
        self.spec = spec
        self.ctx = zmq.asyncio.Context()
        self.ctl = self.ctx.socket(zmq.DEALER)
        self.ctl.setsockopt(zmq.IDENTITY, f"{spec.proc_id}#{spec.incarnation}".encode())
        self.ctl.setsockopt(zmq.LINGER, 2000)
        self.ctl.connect(spec.control)
        self.receivers: dict = {}
        self.senders: list = []  # (route, Sender)
        self.events_tx, self.events_rx = anyio.create_memory_object_stream(float("inf"))
        self.faults = FaultInjector(spec.faults, spec.node, spec.replica)
        self.stopping = False
        self.version = 0
        self.group = None
        self.weight_plan = None
        self.weight_buckets = None
        self.live_weights = None
        self.version_tensor = None
        self.applied: set[str] = set()
        self.pending: list = []  # subscribers: batches waiting for newer weights
        self.sink_next = spec.start_index
        self.sink_buffer: dict[int, tuple] = {}
        self.join_parts: dict[str, dict] = {}
        self.join_done: set[str] = set()
        self.step = 0
        self.wired = False
        self.t_start = time.monotonic()
        self.last_metrics = 0.0
        self.input_labels: dict[str, str] = {}
        self.output_labels: dict[str, str] = {}
        # A consumer that dies is restarted by the controller; until then senders wait rather
        # than fail (the supervision deadline, not the channel, decides when a node is lost).
        self.peer_timeout_s = 300.0

    async def send_ctl(self, msg: dict) -> None:
        await self.ctl.send(control.pack(msg))

    # start-up -------------------------------------------------------------------------------
    async def setup(self) -> None:
        import torch

        from flowrl.graph import load_graph
        from flowrl.graph.kinds import resolve_kind
        from flowrl.metrics import Recorder
        from flowrl.runtime.node import NodeContext
        from flowrl.transport import ChannelConfig, Receiver

        spec = self.spec
        if spec.device_type == "cpu":
            torch.set_num_threads(max(1, len(spec.cpu_cores) or 1))
        graph = load_graph(spec.graph_file, check=False)
        node_spec = graph.nodes[spec.node]
        cls = resolve_kind(node_spec.kind)
        self.cls = cls
        config = cls.Config.model_validate(node_spec.config)
        device = "cpu" if spec.device_type == "cpu" else "cuda:0"
        if spec.device_type == "cuda":
            torch.cuda.set_device(0)
        self.recorder = Recorder(node=spec.node, replica=spec.replica)
        self.nctx = NodeContext(
            name=spec.node, kind=node_spec.kind, replica=spec.replica, replicas=spec.replicas,
            seed=graph.seed, device=device, devices=spec.devices, dtype=node_spec.dtype,
            rank=spec.rank, world_size=spec.world_size, run_dir=Path(spec.run_dir), graph=graph,
            recorder=self.recorder, log=logging.getLogger(f"flowrl.node.{spec.node}"),
        )
        self.nctx.applied = self.applied  # shared: checkpointed with the node's state
        if spec.world_size > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if spec.device_type == "cuda" else "gloo",
                                    rank=spec.rank, world_size=spec.world_size)
        self.node = cls(config, self.nctx)
        self.faults.check_setup() if spec.incarnation == 0 or any(f.every for f in self.faults.faults) else None
        await self.node.setup()
        if spec.resume_from:
            self.load_checkpoint(spec.resume_from)
        if cls.publishes_weights:
            from flowrl.weights import host_store

            self.store = host_store()
        self.input_labels, self.output_labels = edge_labels(graph, spec.node)
        if spec.rank == 0:
            for port, address in spec.inputs.items():
                route_caps = [o for o in graph.edges if o.dst == spec.node and o.dst_port in (None, port)]
                cap = min((e.capacity for e in route_caps), default=4)
                cap_bytes = min((e.capacity_bytes for e in route_caps), default=1 << 30)
                rx = Receiver(ChannelConfig(capacity_messages=cap, capacity_bytes=cap_bytes,
                                            peer_timeout_s=self.peer_timeout_s), name=f"{spec.node}.{port}")
                await rx.bind(address)
                self.receivers[port] = rx

    async def wire(self) -> None:
        """Connect our outputs (the controller says so once every consumer reported READY), then
        start taking input: nothing is processed before its results have somewhere to go."""
        from flowrl.transport import ChannelConfig, Sender

        if self.wired:
            return
        for route in self.spec.outputs:
            cfg = ChannelConfig(capacity_messages=route.capacity, capacity_bytes=route.capacity_bytes,
                                peer_timeout_s=self.peer_timeout_s)
            tx = Sender(cfg, name=route.edge.split("->")[1].strip())  # channels are named by their consumer port
            for address in route.addresses:
                await tx.connect(address)
            self.senders.append((route, tx))
        self.wired = True
        log.info("wired %.2f s after start", time.monotonic() - self.t_start)
        for port, rx in self.receivers.items():
            self.tg.start_soon(self.input_loop, port, rx)
        await self.send_ctl({"t": "wired"})

    def load_checkpoint(self, path: str) -> None:
        import torch

        state = torch.load(path, map_location="cpu", weights_only=False)
        self.node.load_state_dict(state["node"])
        self.applied.update(state.get("applied", []))
        self.version = state.get("version", 0)
        self.nctx.policy_version = self.version
        self.step = state.get("step", 0)

    def save_checkpoint(self, path: str, step: int) -> None:
        import torch

        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            torch.save({"node": self.node.state_dict(), "applied": sorted(self.applied),
                        "version": self.version, "step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    # loops ----------------------------------------------------------------------------------
    async def control_loop(self) -> None:
        while True:
            data = await self.ctl.recv()
            try:
                msg = control.unpack(data)
            except Exception as e:  # noqa: BLE001 - a bad control message is logged, not fatal
                log.warning("dropped bad control message: %s", e)
                continue
            if msg["t"] == "sync" and self.group is not None and msg["epoch"] > self.group.epoch:
                self.group.abort()  # a member died: unblock a broadcast stuck waiting for it
            await self.events_tx.send(("ctl", msg))

    async def input_loop(self, port: str, rx) -> None:
        from flowrl.transport import BrokenChannel, ChannelClosed, EndOfStream

        while True:
            try:
                batch = await rx.recv()
            except (ChannelClosed, EndOfStream):
                return
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
        await self.send_ctl({"t": "hb", "metrics": self.recorder.drain(), "version": self.version})

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
                _, port, batch, rx = event
                await self.on_batch(port, batch, rx)
                if time.monotonic() - self.last_metrics > 0.1:  # metrics land in their own step's row
                    await self.send_metrics()
            if self.stopping:
                return

    # control orders -------------------------------------------------------------------------
    async def on_control(self, msg: dict) -> None:
        t = msg["t"]
        if t == "ticket":
            from flowrl.runtime.node import Ticket

            ticket = Ticket(**{k: msg[k] for k in ("batch_id", "index", "attempt", "min_policy_version", "size")})
            await self.faults.on_batch(self.step)
            self.step += 1
            with self.recorder.span("compute", batch_id=ticket.batch_id):
                batch = await self.node.generate(ticket)
            batch = self.stamp(batch, ticket.batch_id, ticket.attempt, ticket.index, ticket.min_policy_version)
            await self.emit(batch)
        elif t == "sync":
            await self.weight_sync(msg)
        elif t == "checkpoint":
            self.save_checkpoint(msg["path"], msg["step"])
            await self.send_ctl({"t": "checkpointed", "step": msg["step"], "applied": sorted(self.applied),
                                 "version": self.version})
        elif t == "wire":
            await self.wire()
        elif t == "stop":
            self.stopping = True

    # data -----------------------------------------------------------------------------------
    @staticmethod
    def stamp(batch, batch_id, attempt, index, min_version, policy_version=None):
        meta = dict(batch.meta)
        meta["_index"] = index
        meta["_min_version"] = min_version
        kw = dict(batch_id=batch_id, attempt=attempt, meta=meta)
        if policy_version is not None:
            kw["policy_version"] = policy_version
        return batch.replace(**kw)

    async def emit(self, result, port_hint: str | None = None) -> None:
        if result is None:
            return
        outputs = self.cls.outputs
        per_port = result if isinstance(result, dict) else {outputs[0]: result}
        for route, tx in self.senders:
            batch = per_port.get(route.port)
            if batch is None:
                continue
            if await self.faults.on_send(route.addresses, batch):
                continue
            with self.recorder.span("wait_credit", batch_id=batch.batch_id):
                await tx.send(batch)
            self.recorder.count("channel_bytes", batch.nbytes, edge=self.output_labels.get(route.edge, route.edge))
            self.recorder.count("channel_messages", 1, edge=self.output_labels.get(route.edge, route.edge))

    async def on_batch(self, port: str, batch, rx) -> None:
        meta = batch.meta
        index, min_version = meta.get("_index", 0), meta.get("_min_version", 0)
        if self.cls.subscribes_weights and min_version > self.version:
            self.pending.append((port, batch, rx))  # generated later, once the weights arrive
            return
        if not self.cls.outputs:  # sink: consume in ticket order, each ticket once
            await rx.ack(batch)
            if batch.batch_id in self.applied or index < self.sink_next or index in self.sink_buffer:
                await self.send_ctl({"t": "dropped", "batch_id": batch.batch_id, "attempt": batch.attempt, "why": "duplicate"})
                return
            self.sink_buffer[index] = (port, batch)
            while self.sink_next in self.sink_buffer:
                p, b = self.sink_buffer.pop(self.sink_next)
                await self.consume(p, b)
                self.sink_next += 1
            return
        if len(self.cls.inputs) > 1:  # join: gather every input port for a batch id
            bid = batch.batch_id
            if bid in self.join_done:
                await rx.ack(batch)
                await self.send_ctl({"t": "dropped", "batch_id": bid, "attempt": batch.attempt, "why": "duplicate"})
                return
            parts = self.join_parts.setdefault(bid, {})
            parts.setdefault(port, (batch, rx))
            if len(parts) < len(self.cls.inputs):
                return
            del self.join_parts[bid]
            self.join_done.add(bid)
            batches = {p: b for p, (b, _) in parts.items()}
            with self.recorder.span("compute", batch_id=bid):
                result = await self.node.join(batches)
            await self.emit(self.restamp(result, batch))
            for b, r in parts.values():
                await r.ack(b)
            return
        await self.faults.on_batch(self.step)
        with self.recorder.span("compute", batch_id=batch.batch_id):
            result = await self.node.process(batch, port)
        await self.emit(self.restamp(result, batch))
        await rx.ack(batch)
        self.step += 1

    def restamp(self, result, source):
        """Outputs carry the ids of the input they came from."""
        if result is None:
            return None
        pv = source.policy_version
        fix = lambda b: self.stamp(b, source.batch_id, source.attempt, source.meta.get("_index", 0),  # noqa: E731
                                   source.meta.get("_min_version", 0), b.policy_version if b.policy_version >= 0 else pv)
        return {p: fix(b) for p, b in result.items()} if isinstance(result, dict) else fix(result)

    async def consume(self, port: str, batch) -> None:
        await self.faults.on_batch(self.step)
        staleness = self.version - batch.policy_version if batch.policy_version >= 0 else 0
        with self.recorder.span("compute", batch_id=batch.batch_id):
            await self.node.process(batch, port)
        self.applied.add(batch.batch_id)
        self.step += 1
        self.recorder.max("staleness", staleness)
        self.recorder.observe("staleness", staleness)
        await self.send_ctl({"t": "consumed", "batch_id": batch.batch_id, "attempt": batch.attempt,
                             "index": batch.meta.get("_index", 0), "policy_version": batch.policy_version,
                             "staleness": staleness, "metrics": self.recorder.drain()})
        if self.cls.publishes_weights:
            self.version += 1
            self.nctx.policy_version = self.version
            self.snapshot_weights()
            await self.send_ctl({"t": "published", "version": self.version, **self.digest()})

    def snapshot_weights(self) -> None:
        """Publishers: copy the weights into the send buckets, so training can go on meanwhile."""
        from flowrl.weights import BucketPlan, layout_of

        tensors = self.node.weights()
        if self.weight_plan is None:
            self.weight_plan = BucketPlan(layout_of(tensors), self.bucket_bytes)
            self.weight_buckets = self.weight_plan.allocate(self.nctx.device)
        with self.recorder.span("weight_snapshot"):
            self.weight_plan.pack(tensors, out=self.weight_buckets)
        self.version_tensor = self.version_tensor_for(self.version)

    def digest(self) -> dict:
        """With FLOWRL_WEIGHT_DIGEST=1: a digest of the weights this process now holds (tests use it
        to check that rollouts hold bitwise the actor's weights of each version)."""
        if os.environ.get("FLOWRL_WEIGHT_DIGEST") != "1" or self.weight_plan is None:
            return {}
        from flowrl.weights import weights_digest

        if self.cls.publishes_weights:
            tensors = self.weight_plan.views(self.weight_buckets)
        else:
            tensors = self.live_weights
        return {"digest": weights_digest(tensors, self.weight_plan.layout)}

    def version_tensor_for(self, version: int):
        """Travels first in every broadcast: the version the buckets really hold (a newer snapshot
        may have replaced the one a sync order was issued for)."""
        import torch

        return torch.tensor([version], dtype=torch.int64, device=self.nctx.device)

    bucket_bytes = 32 << 20

    # weights --------------------------------------------------------------------------------
    async def weight_sync(self, msg: dict) -> None:
        from flowrl.weights import BucketPlan, WeightGroup, layout_digest, layout_of

        epoch, rank, world = msg["epoch"], msg["rank"], msg["world_size"]
        publisher = self.cls.publishes_weights
        try:
            with self.recorder.span("weight_sync", version=msg["version"]):
                if publisher and self.weight_plan is None:
                    self.snapshot_weights()
                if not publisher and self.weight_plan is None:
                    live = self.node.weights()
                    self.weight_plan = BucketPlan(layout_of(live), self.bucket_bytes)
                    self.weight_buckets = self.weight_plan.allocate(self.nctx.device, live=live)
                    self.live_weights = live
                if self.group is None or self.group.epoch != epoch:
                    if self.group:
                        self.group.close()
                    store = self.store if publisher else tuple(msg["store"])
                    self.group = await anyio.to_thread.run_sync(lambda: WeightGroup.join(
                        epoch=epoch, rank=rank, world_size=world, store=store, timeout_s=msg.get("timeout_s", 60.0),
                        device=self.nctx.device))
                    await anyio.to_thread.run_sync(self.group.check_layout, layout_digest(self.weight_plan.layout))
                if self.faults.fail_sync(msg["version"]):
                    raise RuntimeError("injected weight-sync failure")
                plan, buckets = self.weight_plan, self.weight_buckets
                if not publisher:
                    self.version_tensor = self.version_tensor_for(-1)
                tensors = [self.version_tensor, *buckets]
                drain = None if publisher else (lambda i: plan.drain(i - 1, buckets, self.live_weights) if i else None)
                seconds = await anyio.to_thread.run_sync(lambda: self.group.broadcast(tensors, drain=drain))
                nbytes = sum(b.numel() * b.element_size() for b in buckets)
                self.recorder.count("weight_sync_bytes", nbytes, per_node=True)
                self.recorder.observe("weight_sync_s", seconds, per_node=True)
            version = int(self.version_tensor[0])
            if not publisher:
                self.node.load_weights(self.live_weights, version)
                self.version = version
                self.nctx.policy_version = version
            await self.send_ctl({"t": "synced", "version": version, "epoch": epoch, **self.digest()})
        except Exception as e:  # noqa: BLE001 - reported; the controller forms a new epoch
            if self.group:
                self.group.close()
                self.group = None
            await self.send_ctl({"t": "sync_failed", "epoch": epoch, "error": str(e)})
            return
        if self.pending:
            ready = [p for p in self.pending if p[1].meta.get("_min_version", 0) <= self.version]
            self.pending = [p for p in self.pending if p not in ready]
            for port, batch, rx in ready:
                await self.on_batch(port, batch, rx)

    # lifetime -------------------------------------------------------------------------------
    async def run(self) -> int:
        try:
            await self.setup()
        except Exception as e:  # noqa: BLE001 - the controller shows this and fails fast
            await self.report_error("setup", e)
            return 3
        # what setup built (model, optimizer, imports) lives as long as the node: out of the cyclic
        # collector's way, whose full passes would otherwise walk it again and again (each batch
        # allocates a few dozen objects, so passes come often)
        gc.collect()  # garbage of the start-up goes now; frozen, it would stay
        gc.freeze()
        log.info("ready %.2f s after start (incarnation %d)", time.monotonic() - self.t_start, self.spec.incarnation)
        await self.send_ctl({"t": "ready", "pid": os.getpid(), "store_port": getattr(getattr(self, "store", None), "port", None)})
        self.faults.arm(self.spec.incarnation)
        try:
            async with anyio.create_task_group() as tg:
                self.tg = tg
                tg.start_soon(self.control_loop)
                tg.start_soon(self.metrics_loop)
                tg.start_soon(self.faults.timer_loop)
                await self.main_loop()
                tg.cancel_scope.cancel()
            with anyio.move_on_after(5):
                await self.node.teardown()
        except Exception as e:  # noqa: BLE001
            await self.report_error("process", e)
            return 4
        finally:
            with anyio.CancelScope(shield=True):
                for _, tx in self.senders:
                    with anyio.move_on_after(1):
                        await tx.aclose()
                for rx in self.receivers.values():
                    with anyio.move_on_after(1):
                        await rx.aclose()
        return 0

    async def report_error(self, where: str, e: BaseException) -> None:
        tb = traceback.format_exc()
        log.error("%s failed: %s\n%s", where, e, tb)
        with anyio.move_on_after(2):
            await self.send_ctl({"t": "error", "where": where, "message": f"{type(e).__name__}: {e}", "traceback": tb})


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


class Heartbeat(threading.Thread):
    """Says 'alive' from its own thread and socket, so a long torch call (which releases the GIL)
    does not look like a hang, while a stopped process (SIGSTOP) or a dead controller does."""

    def __init__(self, spec: ProcSpec):
        super().__init__(daemon=True, name="flowrl-heartbeat")
        self.spec = spec
        self.parent = os.getppid()

    def run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.spec.proc_id}#{self.spec.incarnation}#hb".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.spec.control)
        msg = control.pack({"t": "hb"})
        while True:
            if os.getppid() != self.parent:  # our launcher is gone: nobody will stop us
                os._exit(70)
            sock.send(msg)
            time.sleep(self.spec.heartbeat_s)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = ProcSpec.read(argv[0])
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # user node modules resolve as they did for the controller
    bind_devices(spec)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.proc_id} %(levelname)s %(name)s: %(message)s",
                        force=True)
    Heartbeat(spec).start()
    worker = Worker(spec)
    try:
        code = anyio.run(worker.run)
    finally:
        worker.ctl.close(linger=1000)
    return code


if __name__ == "__main__":
    sys.exit(main())
