"""The components of a node process (flowrl/runtime/worker) wired as startup.py wires them, around
fakes: no process, no socket, no node class from a graph. Unit tests of each component use it.

    kit = await build(shape(sink=True, stateful=True), node=Node(), run_dir=tmp_path)
    await kit.path.on_arrival(("in", batch, Rx()))
    assert [type(r).__name__ for r in kit.reports] == ["Consumed"]
    kit.close()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from flowrl.metrics import Recorder
from flowrl.runtime.worker.compute import ComputeThread
from flowrl.runtime.worker.datapath import DataPath
from flowrl.runtime.worker.faults import FaultInjector
from flowrl.runtime.worker.inputs import Policies
from flowrl.runtime.worker.nodestate import NodeState
from flowrl.runtime.worker.orders import OrderTaker
from flowrl.runtime.worker.outputs import Outputs
from flowrl.runtime.worker.ranks import RankGroup
from flowrl.runtime.worker.runner import NodeRunner
from flowrl.runtime.worker.shape import Shape
from flowrl.runtime.worker.steps import GroupSteps
from flowrl.runtime.worker.syncs import WeightSyncs
from flowrl.runtime.worker.version import WeightVersion


class Tx:
    """A channel that keeps what was sent on it."""

    def __init__(self):
        self.sent = []

    async def send(self, batch):
        self.sent.append(batch)


class Rx:
    """A channel end that records the batch ids acknowledged."""

    def __init__(self, replies=()):
        self.acked = []
        self.replies = list(replies)

    async def recv(self):
        return self.replies.pop(0)

    async def ack(self, batch):
        self.acked.append(batch.batch_id)


class Node:
    """A node that passes batches through and keeps the batch ids it saw as its state."""

    def __init__(self):
        self.seen: list[str] = []
        self.setups = 0

    async def setup(self):
        self.setups += 1

    async def process(self, batch, port):
        self.seen.append(batch.batch_id)
        return batch

    def state_dict(self):
        return {"seen": list(self.seen)}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])


def shape(**flags) -> Shape:
    """A transform with one input and one output, changed by `flags`."""
    base = dict(source=False, observer=False, sink=False, join=False, stateful=False, publishes=False,
                subscribes=False, inputs=("in",), outputs=("out",), requires={})
    base.update(flags)
    if base["sink"] and "outputs" not in flags:
        base["outputs"] = ()
    return Shape(**base)


@dataclass
class Kit:
    ctx: SimpleNamespace
    version: WeightVersion
    runner: NodeRunner
    state: NodeState
    syncs: WeightSyncs
    ranks: RankGroup | None
    steps: GroupSteps
    outputs: Outputs
    path: DataPath
    orders: OrderTaker
    policies: Policies
    compute: ComputeThread
    reports: list = field(default_factory=list)

    def close(self) -> None:
        self.compute.close()


async def build(sh: Shape | None = None, *, node=None, run_dir=".", epoch: int = 0, watermark: int = 0,
                rank: int = 0, world_size: int = 1, rank_rx=None, peers: dict | None = None, weights=None,
                steps: int = 100, checkpoint_every: int = 0, senders=(), fetch: bool = False) -> Kit:
    sh = sh or shape()
    node = node or Node()
    reports: list = []

    async def report(msg):
        reports.append(msg)

    compute, faults, recorder = ComputeThread("test"), FaultInjector([], "n", 0, rank), Recorder("n")
    ctx = SimpleNamespace(policy_version=0)
    version = WeightVersion(ctx)
    policies = Policies.of(sh, epoch, watermark)
    runner = NodeRunner(compute, faults, recorder, make=lambda: node)
    await runner.build()
    state = NodeState(runner, version, policies.fence, faults=faults, recorder=recorder, report=report,
                      publishes=sh.publishes, run_dir=str(run_dir), log_name="n.0.0", steps=steps,
                      checkpoint_every=checkpoint_every)
    if weights is not None:
        state.serve_weights(weights)
    outputs = Outputs("n", sh, faults, recorder, version, report, {}, curve=lambda key: None)
    for route, tx in senders:
        outputs.add(route, tx)
    ranks = None
    if world_size > 1:
        ranks = RankGroup(rank, world_size, rank_rx, runner=runner, faults=faults, recorder=recorder, shape=sh,
                          outputs=outputs, fence=policies.fence, node="n")
        for r, tx in (peers or {}).items():
            ranks.add_peer(r, tx)

    async def released(v: int) -> None:
        await path.release(v)

    syncs = WeightSyncs(weights, runner, version, policies.fence, shape=sh, ranks=ranks, report=report,
                        released=released, fetch=fetch)
    group_steps = GroupSteps(state, syncs, ranks, policies.fence)
    path = DataPath(sh, policies, node="n", runner=runner, outputs=outputs, steps=group_steps, state=state,
                    ranks=ranks, version=version, recorder=recorder, report=report, labels={}, started=0.0)
    orders = OrderTaker(path, state, group_steps, version, policies.fence, shape=sh, rank=rank, report=report)
    return Kit(ctx, version, runner, state, syncs, ranks, group_steps, outputs, path, orders, policies, compute,
               reports)
