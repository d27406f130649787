"""A node process: binds its inputs, reports READY, then feeds work through its node until stopped.

    python -m flowrl.runtime.worker RUN_DIR/procs/rollout.0.0.json

Order of start-up matters: devices are fixed (affinity / CUDA_VISIBLE_DEVICES) before anything
can touch CUDA, the node's `setup` runs and its input channels are bound before READY is reported,
so the controller only relies on a process that can already receive.

One event loop, one consumer: batches from every input, tickets and control orders are put on one
queue and handled in order, so weight swaps, checkpoints and rollbacks always fall between two
calls into the node. What to do with each arrival is decided by the input policies of the node's
shape (`inputs.py`): fence (recovery epochs), version gate (subscribers), join buffer, in-order
delivery with an output cache (stateful nodes), and once-only consumption (sinks).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from flowrl.runtime import messages as m
from flowrl.runtime.addresses import apply_control_client, input_security, output_curve
from flowrl.runtime.faults import FaultInjector
from flowrl.runtime.inputs import Fence, Item, JoinBuffer, Ordered, OutputCache, SinkSeen, VersionGate
from flowrl.node import Drop, Ticket
from flowrl.runtime.heartbeat import Heartbeat
from flowrl.runtime.procspec import ProcSpec
from flowrl.runtime.ranks import SHARD, RankMember

log = logging.getLogger("flowrl.worker")


def bind_devices(spec: ProcSpec) -> None:
    """Fix this process's devices before torch (or CUDA) is used."""
    os.environ.update(spec.env)
    if spec.device_type == "cpu" and spec.cpu_cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec.cpu_cores)


class Worker(RankMember):
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
        self.peer_timeout_s = 300.0
        # every data channel of the run proves this (a stray local process cannot join a link)
        self.channel_secret = spec.secret.encode() if spec.secret else None

    async def send_ctl(self, msg) -> None:
        await self.ctl.send(m.encode(msg, self.spec.secret))

    # start-up -------------------------------------------------------------------------------
    async def setup(self) -> None:
        import torch

        from flowrl.graph import load_graph
        from flowrl.graph.kinds import resolve_kind
        from flowrl.metrics import Recorder
        from flowrl.node import NodeContext, Source
        from flowrl.runtime.weightsync import WeightsClient
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
        self.recorder = Recorder(node=spec.node, replica=spec.replica)
        self.nctx = NodeContext(
            name=spec.node, kind=node_spec.kind, replica=spec.replica, replicas=spec.replicas,
            seed=graph.seed, device=device, devices=spec.devices, dtype=node_spec.dtype,
            rank=spec.rank, world_size=spec.world_size, run_dir=Path(spec.run_dir), graph=graph,
            recorder=self.recorder, log=logging.getLogger(f"flowrl.node.{spec.node}"),
        )
        # the node's shape decides its input policies
        self.is_source = issubclass(cls, Source)
        self.is_observer = not self.is_source and not cls.inputs and not cls.outputs
        self.is_sink = not cls.outputs and not self.is_observer
        self.is_join = len(cls.inputs) > 1
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
        self.node = cls(self.config, self.nctx)
        if spec.incarnation == 0 or any(f.every for f in self.faults.faults):
            self.faults.check_setup()
        await self.node.setup()
        if spec.resume_from:
            self.load_checkpoint(spec.resume_from)
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
        if self.dp:
            if self.is_source or self.is_join or len(cls.outputs) > 1:
                raise ValueError(f"node {spec.node!r}: data parallelism (devices: {spec.world_size}) splits each batch "
                                 "over the ranks of a transform or sink with one output port; for a source, a join "
                                 "or several outputs use replicas instead")
            self.rank_rx = Receiver(ChannelConfig(capacity_messages=4, peer_timeout_s=self.peer_timeout_s, secret=self.channel_secret),
                                    name=f"{spec.node}.rank{spec.rank}")
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
                              name=f"{spec.node}.{port}")
                await rx.bind(address)
                self.receivers[port] = rx

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
            tx = Sender(cfg, name=route.edge.split("->")[1].strip())  # channels are named by their consumer port
            for address in route.addresses:
                await tx.connect(address, curve=self.output_curve(route.keys.get(address)))
            self.senders.append((route, tx))
        self.wired = True
        log.info("wired %.2f s after start", time.monotonic() - self.t_start)
        if self.dp:  # the leader sends shards to every follower; followers send results back to it
            peers = range(1, self.spec.world_size) if self.spec.rank == 0 else [0]
            for r in peers:
                tx = Sender(ChannelConfig(capacity_messages=4, peer_timeout_s=self.peer_timeout_s, secret=self.channel_secret), name=f"rank{r}")
                await tx.connect(self.spec.rank_addresses[r])
                self.rank_tx[r] = tx
            if self.spec.rank > 0:
                self.tg.start_soon(self.input_loop, SHARD, self.rank_rx)
        for port, rx in self.receivers.items():
            self.tg.start_soon(self.input_loop, port, rx)
        await self.send_ctl(m.Wired(epoch=self.fence.epoch))

    # checkpoints ----------------------------------------------------------------------------
    def load_checkpoint(self, path: str) -> None:
        from flowrl.runtime.checkpoints import load_state

        state = load_state(Path(path))
        self.node.load_state_dict(state["node"])
        if self.cls.publishes_weights:
            self.version = state.get("version", 0)
            self.nctx.policy_version = self.version

    def is_checkpoint_step(self, watermark: int) -> bool:
        return watermark == self.steps or (self.checkpoint_every > 0 and watermark % self.checkpoint_every == 0)

    async def save_checkpoint(self, step: int) -> None:
        """Save the state as of watermark `step` (every ticket < step applied, none after)."""
        from flowrl.runtime.checkpoints import file_name, save_state

        self.faults.on_checkpoint(step)
        self.saved_at = (self.fence.epoch, step)
        name = file_name(self.spec.log_name, step, self.fence.epoch)
        with self.recorder.span("checkpoint", step=step):
            save_state(Path(self.spec.run_dir) / "checkpoints" / name, self.node.state_dict(), step=step,
                       epoch=self.fence.epoch, version=self.version)
        await self.send_ctl(m.Checkpointed(step=step, epoch=self.fence.epoch, file=name, version=max(self.version, 0)))

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
        await self.send_ctl(m.Heartbeat(metrics=self.recorder.drain(), version=self.version))

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

    # control orders -------------------------------------------------------------------------
    async def on_control(self, msg) -> None:
        if isinstance(msg, m.TicketMsg):
            ticket = Ticket(batch_id=msg.batch_id, index=msg.index, attempt=msg.attempt,
                            min_policy_version=msg.min_policy_version, size=msg.size, epoch=msg.epoch)
            await self.on_arrival((None, ticket, None))
        elif isinstance(msg, m.Sync):
            await self.weight_sync(msg)
        elif isinstance(msg, m.Epoch):
            await self.enter_epoch(msg)
        elif isinstance(msg, m.Progress):
            self.forget_below(msg.complete_below)
            await self.extend_to(msg.steps)
        elif isinstance(msg, m.Wire):
            await self.wire(msg.routes)
        elif isinstance(msg, (m.Connect, m.Disconnect)):
            await self.rewire(msg)
        elif isinstance(msg, m.Stop):
            self.stopping = True

    async def rewire(self, msg) -> None:
        """A consumer replica was added or removed (`flowrl scale`)."""
        for route, tx in self.senders:
            if route.edge != msg.edge:
                continue
            if isinstance(msg, m.Connect) and msg.address not in route.addresses:
                route.addresses.append(msg.address)
                if msg.key:
                    route.keys[msg.address] = msg.key
                await tx.connect(msg.address, wait=False, curve=self.output_curve(msg.key))
            elif isinstance(msg, m.Disconnect) and msg.address in route.addresses:
                route.addresses.remove(msg.address)
                for batch in await tx.disconnect(msg.address):  # not acknowledged there: to the others
                    await tx.send(batch)

    async def extend_to(self, steps: int) -> None:
        """The run's end moved (replaced tickets): its final checkpoint is at the new end; if this
        node got there before it heard, it saves now (its state is the state after `steps`)."""
        if steps == self.steps:
            return
        self.steps = steps
        if self.ordered is not None and self.ordered.watermark == steps and self.saved_at != (self.fence.epoch, steps):
            await self.save_checkpoint(steps)

    def forget_below(self, index: int) -> None:
        if self.cache is not None:
            self.cache.forget_below(index)
        if self.joins is not None:
            self.joins.forget_below(index)

    async def enter_epoch(self, msg: m.Epoch) -> None:
        """A stateful node restarted somewhere: drop everything of the old epoch, roll back."""
        if msg.epoch <= self.fence.epoch:  # an order sent again: we are there already, nothing changes
            await self.send_ctl(m.Recovered(epoch=self.fence.epoch))
            return
        stale = [(r, b, "recovery") for _, b, r in self.gate.clear()]
        if self.joins is not None:
            stale += self.joins.clear()
        for r, b, why in stale:
            await self.discard(r, b, why)
        if self.stateful:
            for item in self.ordered.reset(msg.watermark):  # already acked when buffered
                await self.send_ctl(m.Duplicate(batch_id=item.batch_id, attempt=item.attempt, why="recovery"))
            self.cache and self.cache.clear()
            if msg.checkpoint:
                self.load_checkpoint(msg.checkpoint)
            else:  # nothing committed yet: back to the state right after setup
                self.node = self.cls(self.config, self.nctx)
                await self.node.setup()
                self.version = 0
            if self.cls.publishes_weights:
                self.publish_snapshot()
        if self.seen is not None:
            self.seen.reset(msg.watermark, msg.consumed)
        if self.cls.subscribes_weights:
            self.version = -1  # hold every batch until the publisher's restored weights arrive
        held = self.fence.enter(msg.epoch)
        await self.send_ctl(m.Recovered(epoch=msg.epoch))
        if self.stateful and not msg.checkpoint:
            await self.save_checkpoint(msg.watermark)
        for arrival in held:
            await self.on_arrival(arrival)

    # data -----------------------------------------------------------------------------------
    async def on_arrival(self, arrival) -> None:
        """One batch (port, batch, rx) or ticket (None, ticket, None) from the event queue."""
        port, work, rx = arrival
        if port == SHARD:
            await self.on_shard(work, rx)
            return
        verdict = self.fence.classify(work.epoch)
        if verdict == "stale":
            if rx is not None:
                await self.discard(rx, work, "stale epoch")
            return
        if verdict == "future":
            self.fence.future.append(arrival)
            return
        if rx is not None and self.cls.subscribes_weights and work.drop is None \
                and not self.gate.admits(work.min_version, self.version):
            self.gate.hold(arrival)  # generated later, once the weights arrive
            return
        if rx is not None and work.drop is None and self.cls.requires:
            problem = missing_tensors(work, self.cls.requires)
            if problem:
                self.recorder.count("batches_rejected", 1, edge=self.input_labels.get(port, port))
                log.warning("rejected batch %s on %s: %s", work.batch_id, port, problem)
                await self.discard(rx, work, f"invalid: {problem}")
                return
        if rx is None:
            item = Item(work.index, work.batch_id, work.attempt, work.epoch, None, work,
                        min_version=work.min_policy_version)
        elif self.is_join:
            item, drops = self.joins.offer(port, work, rx)
            for r, b, why in drops:
                await self.discard(r, b, why)
            if item is None:
                return
        else:
            item = Item.of_batch(port, work, rx)
        await self.admit(item)

    async def admit(self, item: Item) -> None:
        if self.ordered is not None:
            verdict = self.ordered.offer(item)
            if verdict != "buffered":
                await self.replay(item) if verdict == "replay" else await self.discard_item(item, "duplicate")
                return
            await self.ack(item)  # buffered work gives its credit back now: order never blocks a channel
            while (nxt := self.ordered.next_ready()) is not None:
                await self.run(nxt)
                self.ordered.done(nxt.index)
                if self.is_checkpoint_step(self.ordered.watermark):
                    await self.save_checkpoint(self.ordered.watermark)
            return
        if self.seen is not None and not self.seen.first_time(item.index):
            await self.discard_item(item, "already consumed by this sink")
            return
        await self.run(item)
        await self.ack(item)

    async def replay(self, item: Item) -> None:
        """A ticket this stateful node already applied: send its output again, state untouched."""
        cached = self.cache.get(item.index) if self.cache is not None else None
        await self.ack(item)
        if cached is None:
            await self.send_ctl(m.Duplicate(batch_id=item.batch_id, attempt=item.attempt, why="already applied"))
            return
        await self.emit({p: b if isinstance(b, Drop) else b.replace(attempt=item.attempt) for p, b in cached.items()},
                        item)

    async def run(self, item: Item) -> None:
        """Call the node once for `item` and send what it returned (or the drop marker)."""
        from flowrl.runtime.contract import outputs_of

        if self.step == 0 and item.drop is None:
            log.info("first batch %.2f s after start (at %.6f)", time.monotonic() - self.t_start, time.time())
        if item.drop is not None:  # a drop marker passes through without a call, on every output
            result = Drop(item.drop) if self.is_sink else {p: Drop(item.drop) for p in self.cls.outputs}
            if self.dp:
                await self.tell_followers(item)  # they follow every ticket, drops too
        else:
            method = "generate" if self.is_source else "join" if self.is_join else "process"
            self.busy = (item.batch_id, time.monotonic())
            try:
                await self.faults.on_batch(self.step)
                self.step += 1
                with self.recorder.span("compute", batch_id=item.batch_id):
                    if self.is_source:
                        result = await self.node.generate(item.batch)
                    elif self.is_join:
                        result = await self.node.join(item.parts)
                    elif self.dp:
                        result = await self.run_ranks(item, method)
                    else:
                        result = await self.node.process(item.batch, item.port)
            except BaseException:
                self.failed_on = item.batch_id  # named on the last-error line
                raise
            finally:
                self.busy = None
            if self.is_sink:
                result = None
            else:
                result = outputs_of(result, node=self.spec.node, method=method, ports=self.cls.outputs)
        if self.is_sink:
            await self.consume(item, result if isinstance(result, Drop) else None)
            return
        outputs = {p: self.stamp(b, item) for p, b in result.items()}
        await self.emit(outputs, item)
        if self.cache is not None:
            self.cache.put(item.index, outputs)

    def stamp(self, out, item: Item):
        """Outputs carry the routing facts of the work they came from."""
        from flowrl.transport import Batch

        src = item.batch if item.parts is None else next(iter(item.parts.values()))
        min_version = src.min_version if item.min_version is None else item.min_version
        pv = -1 if self.is_source else src.policy_version
        if isinstance(out, Drop):
            if out.replace and item.drop is None and not self.stateful:
                from flowrl.runtime.contract import NodeContractError

                raise NodeContractError(
                    f"node {self.spec.node!r} returned Drop(replace=True) but is not stateful: what it holds for a "
                    "later ticket would be lost when it restarts. Set `stateful = True` and save what it holds "
                    "in state_dict, or return a plain Drop")
            reason = out.reason if item.drop is not None else \
                Drop(f"{self.spec.node}: {out.reason}", replace=out.replace).marker
            return Batch(batch_id=item.batch_id, attempt=item.attempt, index=item.index, min_version=min_version,
                         epoch=item.epoch, drop=reason[:1000], policy_version=pv)
        return out.replace(batch_id=item.batch_id, attempt=item.attempt, index=item.index, min_version=min_version,
                           epoch=item.epoch, policy_version=out.policy_version if out.policy_version >= 0 else pv)

    async def emit(self, outputs: dict, item: Item) -> None:
        for route, tx in self.senders:
            batch = outputs[route.port]
            forged = self.faults.forged(batch)
            if forged is not None:
                await tx.send(forged)
            if await self.faults.on_send(route.addresses, batch):
                continue
            with self.recorder.span("wait_credit", batch_id=batch.batch_id):
                await tx.send(batch)
            label = self.output_labels.get(route.edge, route.edge)
            self.recorder.count("channel_bytes", batch.nbytes, edge=label)
            self.recorder.count("channel_messages", 1, edge=label)

    async def consume(self, item: Item, dropped: Drop | None) -> None:
        batch = item.batch if item.parts is None else next(iter(item.parts.values()))
        pv = batch.policy_version
        staleness = self.version - pv if pv >= 0 and dropped is None else 0
        if dropped is None:
            self.recorder.max("staleness", staleness)
            self.recorder.observe("staleness", staleness)
        await self.send_ctl(m.Consumed(batch_id=item.batch_id, attempt=item.attempt, index=item.index,
                                       epoch=item.epoch, policy_version=pv, staleness=staleness,
                                       dropped_by=dropped.reason if dropped else None, metrics=self.recorder.drain()))
        if self.cls.publishes_weights:
            self.version += 1
            self.nctx.policy_version = self.version
            self.publish_snapshot()
            await self.send_ctl(m.Published(version=self.version, epoch=self.fence.epoch, **self.weights.digest()))

    def publish_snapshot(self) -> None:
        """Trainers: copy the weights out for the next broadcast. On a data-parallel trainer the
        full tensors are gathered from every rank, so the other ranks take part at the same point."""
        if self.weights is not None:
            self.weights.snapshot(self.version)
        else:
            drain = getattr(self.node.weights(), "drain", None)
            if drain is not None:
                drain()

    async def ack(self, item: Item) -> None:
        for rx, batch in item.acks:
            await rx.ack(batch)
        item.acks = []

    async def discard(self, rx, batch, why: str) -> None:
        await rx.ack(batch)
        await self.send_ctl(m.Duplicate(batch_id=batch.batch_id, attempt=batch.attempt, why=why))

    async def discard_item(self, item: Item, why: str) -> None:
        await self.ack(item)
        await self.send_ctl(m.Duplicate(batch_id=item.batch_id, attempt=item.attempt, why=why))

    # weights --------------------------------------------------------------------------------
    async def weight_sync(self, order: m.Sync) -> None:

        self.busy = (f"weight sync v{order.version}", time.monotonic())
        try:
            received = await self.weights.sync(order, self.version)
        except Exception as e:  # noqa: BLE001 - reported; the controller forms a new epoch
            from flowrl.weights import LayoutMismatchError

            await self.send_ctl(m.SyncFailed(sync_epoch=order.sync_epoch, error=str(e)[:2000],
                                             permanent=isinstance(e, LayoutMismatchError)))
            return
        finally:
            self.busy = None
        if not self.cls.publishes_weights:
            self.version = received
            self.nctx.policy_version = received
        await self.send_ctl(m.Synced(version=received, sync_epoch=order.sync_epoch, **self.weights.digest()))
        for arrival in self.gate.release(self.version):
            await self.on_arrival(arrival)
        if self.is_observer:
            self.busy = (f"observe v{received}", time.monotonic())
            try:
                await self.node.observe(received)
            finally:
                self.busy = None

    # lifetime -------------------------------------------------------------------------------
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
            self.publish_snapshot()  # version 0 (or the checkpoint's), before anything can ask for it
        store_port = self.weights.store_port if self.weights is not None else None
        await self.send_ctl(m.Ready(pid=os.getpid(), store_port=store_port,
                                    inputs={port: rx.address for port, rx in self.receivers.items()}))
        self.faults.arm(self.spec.incarnation)
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
                await self.node.teardown()
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
        return 0

    async def report_error(self, where: str, e: BaseException) -> None:
        from flowrl.runtime.contract import describe_error

        info = describe_error(e)
        batch_id = getattr(self, "failed_on", None) or (self.busy[0] if self.busy else None)
        log.error("%s failed: %s: %s\n%s", where, info["type"], info["message"], info["traceback"])
        with anyio.move_on_after(2):
            await self.send_ctl(m.Error(where=where, type=info["type"], message=info["message"], file=info["file"],
                                        line=info["line"], batch_id=batch_id, traceback=info["traceback"]))


def missing_tensors(batch, requires: dict) -> str | None:
    """What a batch lacks of a node's declared input, or None."""
    from flowrl.transport.dtypes import dtype_name

    for name, dtype in requires.items():
        t = batch.tensors.get(name)
        if t is None:
            return f"no tensor {name!r} (has {sorted(batch.tensors)[:8]})"
        if dtype is not None and dtype_name(t) != dtype:
            return f"tensor {name!r} is {dtype_name(t)}, the node takes {dtype}"
    return None


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
    heartbeat = Heartbeat(spec)
    worker = Worker(spec)
    heartbeat.worker = worker
    heartbeat.start()
    try:
        code = anyio.run(worker.run_node)
    finally:
        worker.ctl.close(linger=1000)
    return code


if __name__ == "__main__":
    sys.exit(main())
