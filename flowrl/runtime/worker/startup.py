"""Start-up of a node process: its node built from the graph, and the components that serve it,
each given what it needs (worker.py then binds the channels and reports READY).

    parts = await build_parts(spec, compute, faults, report=worker.send_ctl, started=t0,
                              open_rank_channel=worker.open_rank_channel)
    await parts.path.on_arrival(...)

Order matters and is the one the node sees: devices and the process group first, then the node's
`setup`, then a checkpoint to resume from, then the weight client (which reads the node's weights).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.runtime.protocol.procspec import ProcSpec
from flowrl.runtime.worker.compute import ComputeThread
from flowrl.runtime.worker.datapath import DataPath
from flowrl.runtime.worker.faults import FaultInjector
from flowrl.runtime.worker.group import join_node_group
from flowrl.runtime.worker.inputs import Policies
from flowrl.runtime.worker.nodestate import NodeState
from flowrl.runtime.worker.orders import OrderTaker
from flowrl.runtime.worker.outputs import Outputs
from flowrl.runtime.worker.ranks import RankGroup
from flowrl.runtime.worker.runner import NodeRunner
from flowrl.runtime.worker.shape import Shape
from flowrl.runtime.worker.steps import GroupSteps
from flowrl.runtime.worker.syncs import WeightSyncs
from flowrl.runtime.worker.turns import TurnClient
from flowrl.runtime.worker.version import WeightVersion


@dataclass(frozen=True)
class Parts:
    """The components of one node process, wired to each other at start-up (nobody reassigns them)."""

    graph: Any
    shape: Shape
    recorder: Any
    version: WeightVersion
    runner: NodeRunner
    state: NodeState
    weights: Any  # WeightsClient or None
    outputs: Outputs
    ranks: RankGroup | None
    syncs: WeightSyncs
    steps: GroupSteps
    path: DataPath
    orders: OrderTaker
    input_labels: dict[str, str]
    turns: TurnClient  # this process's turn on devices shared with nodes that take turns (turns.py)


def cpu_threads(n: int) -> None:
    """torch's intra-op threads: the process's cores. Set here if the fork server preloaded torch;
    otherwise torch reads them from the plan's OMP_NUM_THREADS (`bind_devices`) if this process
    ever imports it (a node whose `preload` is `()` need not)."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


async def build_parts(spec: ProcSpec, compute: ComputeThread, faults: FaultInjector, *,
                      report: Callable[[Any], Awaitable[None]], started: float,
                      open_rank_channel: Callable[[], Awaitable[Any]], services: dict | None = None) -> Parts:
    """The node built and set up, and every component around it. `open_rank_channel`: binds this
    rank's channel from its data-parallel peers and returns it (the worker owns channels);
    `services`: what the node sees as `ctx.services` (the worker owns their sockets)."""
    from flowrl.graph import load_graph
    from flowrl.metrics import Recorder
    from flowrl.node import NodeContext
    from flowrl.runtime.protocol.addresses import output_curve
    from flowrl.runtime.worker.fused import node_class
    from flowrl.runtime.worker.weightsync import WeightsClient

    if spec.device_type == "cpu":
        cpu_threads(max(1, len(spec.cpu_cores) or 1))
    graph = load_graph(own_graph_file(spec), check=False)
    node_spec = graph.nodes[spec.node]
    cls = node_class(node_spec)  # its kind's class, running its fused nodes if any
    config = cls.Config.model_validate(node_spec.config)
    device = "cpu" if spec.device_type == "cpu" else "cuda:0"
    if spec.device_type == "cuda":
        import torch

        torch.cuda.set_device(0)
        await compute.call(torch.cuda.set_device, 0)  # the current device is per thread
    recorder = Recorder(node=spec.node, replica=spec.replica)
    nctx = NodeContext(
        name=spec.node, kind=node_spec.kind, replica=spec.replica, replicas=spec.replicas,
        seed=graph.seed, device=device, devices=spec.devices, dtype=node_spec.dtype,
        rank=spec.rank, world_size=spec.world_size, run_dir=Path(spec.home), graph=graph,
        recorder=recorder, log=logging.getLogger(f"flowrl.node.{spec.node}"),
    )
    if services is not None:
        nctx.services = services
    shape = Shape.of(cls)  # the node's shape decides its input policies
    version = WeightVersion(nctx)
    sched = graph.schedule
    policies = Policies.of(shape, spec.epoch, spec.watermark, spec.consumed, per_update=sched.tickets_per_update)
    if spec.world_size > 1:  # the replica's own group: a sealed store on rank 0's host address
        join_node_group(spec, timeout_s=graph.supervision.startup_timeout_s)
    if spec.incarnation == 0 or any(f.every for f in faults.faults):
        faults.check_setup()
    runner = NodeRunner(compute, faults, recorder, make=lambda: cls(config, nctx))
    runner.turns = turns = TurnClient(spec.turn_group, proc_id=spec.proc_id, timeout_s=spec.turn_timeout_s,
                                      run=compute.call, node=lambda: runner.node, report=report, recorder=recorder)
    await runner.build()
    state = NodeState(runner, version, policies.fence, faults=faults, recorder=recorder, report=report,
                      publishes=shape.publishes, run_dir=spec.home, log_name=spec.log_name,
                      steps=spec.steps or sched.total_tickets, checkpoint_every=sched.checkpoint_every_tickets,
                      copy_dir=spec.checkpoint_copy)
    if spec.resume_from:
        await state.load(spec.resume_from)
    weights = None
    if (shape.publishes and spec.rank == 0) or shape.subscribes:  # a trainer's rank 0 publishes
        weights = WeightsClient(runner.node, publisher=shape.publishes, device=device,
                                recorder=recorder, faults=faults, secret=spec.secret,
                                serving_dtype=spec.serving_dtype, host=spec.host_address,
                                ready_timeout_s=graph.supervision.process_timeout_s,
                                region_name=f"flowrl-{Path(spec.run_dir).name}-{spec.log_name}")
        state.serve_weights(weights)
    if shape.subscribes and spec.epoch > 0:
        version.forget()  # after a rollback only the publisher's restored weights count
    input_labels, output_labels = edge_labels(graph, spec.node)
    ranks = None
    outputs = Outputs(spec.node, shape, faults, recorder, version, report, output_labels,
                      curve=lambda key: output_curve(spec, key))
    outputs.per_update = sched.tickets_per_update
    if spec.world_size > 1:
        if shape.source or shape.join or len(shape.outputs) > 1:
            raise ValueError(f"node {spec.node!r}: data parallelism (devices: {spec.world_size}) splits each batch "
                             "over the ranks of a transform or sink with one output port; for a source, a join "
                             "or several outputs use replicas instead")
        ranks = RankGroup(spec.rank, spec.world_size, await open_rank_channel(), runner=runner, faults=faults,
                          recorder=recorder, shape=shape, outputs=outputs, fence=policies.fence, node=spec.node)

    async def released(v: int) -> None:  # a subscriber's new version: held batches go on (`path`, made below)
        await path.release(v)

    # calls at once only where nothing orders them (`flowrl check`: concurrency-unsupported)
    concurrency = 1 if shape.stateful or spec.world_size > 1 else node_spec.concurrency
    syncs = WeightSyncs(weights, runner, version, policies.fence, shape=shape, ranks=ranks, report=report,
                        released=released, fetch=concurrency == 1 and spec.turn_group is None)
    steps = GroupSteps(state, syncs, ranks, policies.fence)
    path = DataPath(shape, policies, node=spec.node, runner=runner, outputs=outputs, steps=steps, state=state,
                    ranks=ranks, version=version, recorder=recorder, report=report, labels=input_labels,
                    started=started, max_staleness=sched.max_staleness,
                    concurrency=concurrency)
    orders = OrderTaker(path, state, steps, version, policies.fence, shape=shape, rank=spec.rank, report=report)
    return Parts(graph=graph, shape=shape, recorder=recorder, version=version, runner=runner, state=state,
                 weights=weights, outputs=outputs, ranks=ranks, syncs=syncs, steps=steps, path=path, orders=orders,
                 input_labels=input_labels, turns=turns)


def own_graph_file(spec: ProcSpec) -> str:
    """The graph file to read: the spec's, written from the text it carries first when this host
    has no copy (a host folder of `launcher.host_dirs`: the controller's folder is not here)."""
    path = Path(spec.graph_file)
    if spec.graph_text and not (path.exists() and path.read_text() == spec.graph_text):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(spec.graph_text)
        os.replace(tmp, path)  # a reader never sees half a graph
    return str(path)


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
