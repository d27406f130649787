"""The Node API: what a user writes to put their own code into a flowrl graph.

A node is a class with declared ports, a typed config and async hooks. The runtime runs each
replica of it in its own process, feeds it batches from its input channels and sends what it
returns to its output channels. A worked example (`examples/custom_node/nodes.py`)::

    import flowrl

    class Scale(flowrl.Node):
        '''Multiplies every tensor named `x` by a factor.'''

        class Config(flowrl.NodeConfig):
            factor: float = 2.0

        async def process(self, batch, port):
            return batch.replace(tensors={**batch.tensors, "x": batch.tensors["x"] * self.config.factor})

and in the graph file: `scale: {kind: "examples.custom_node.nodes:Scale", config: {factor: 3}}`.

Rules the runtime relies on:
- Module import must be light (no `import torch` at module level in node modules): `flowrl check`
  imports node classes to learn their ports and must stay fast. Import heavy things in `setup`.
- `process`, `generate`, `join`, `setup`, `teardown` and `observe` are `async def` (checked when
  the graph loads).
- Nodes that are not `stateful` keep no state between batches: after a crash the runtime restarts
  them and replays their in-flight work, so `process` must give the same result for the same input.
- Stateful nodes (trainers, running statistics) implement `state_dict` / `load_state_dict` with
  tensors and plain data only. The runtime hands them tickets in index order, each exactly once,
  and checkpoints them at the same ticket as every other stateful node; when any of them restarts,
  all of them roll back to the last consistent checkpoint and the tickets after it are replayed
  (docs/recovery.md).
- Returning None (or `flowrl.Drop("why")`, or a batch with no samples) drops the ticket: a drop
  marker flows on and every sink records the ticket as dropped. `flowrl.Drop("why", replace=True)`
  also asks the scheduler for one more ticket in its place (the work is held for a later ticket). A dict result sends on the ports
  it names; ports it leaves out get the drop marker. Two edges from one output port both get
  every batch (broadcast). Samples of one prompt group are contiguous in a batch
  (`meta["samples_per_prompt"]` long each).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from flowrl.schema import StrictModel

if TYPE_CHECKING:
    from flowrl.transport import Batch


class NodeConfig(StrictModel):
    """Base of a node's `Config`: unknown keys are rejected, like everywhere in a graph file."""


@dataclass
class Ticket:
    """One unit of work issued by the scheduler to the source nodes."""

    batch_id: str
    index: int
    """Position in the run's work sequence: the data cursor (a pure function of it gives the data)."""
    attempt: int
    min_policy_version: int
    """Rollouts must hold weights of at least this version before generating this work."""
    size: int
    """Work items (prompts) in this ticket."""
    epoch: int = 0
    """Recovery epoch the ticket was issued in (set by the runtime)."""

    @property
    def min_version(self) -> int:
        """`min_policy_version`, under the name a batch's route gives it (a subscribing source's
        version gate holds tickets as a rollout's holds batches)."""
        return self.min_policy_version


@dataclass(frozen=True)
class Drop:
    """Return `flowrl.Drop("no reward variance")` from `process`/`join`/`generate` to drop a
    ticket with a reason (returning None drops it too, with reason "returned None").

    `Drop(reason, replace=True)` says the ticket's work is held for a later ticket, not lost (a
    DAPO filter filling a batch with the groups of several tickets): the scheduler issues one more
    ticket in its place, so the run still makes `schedule.steps` training updates (at most
    `schedule.max_replaced` extra tickets per run)."""

    reason: str = "dropped"
    replace: bool = False

    @property
    def marker(self) -> str:
        """The drop marker's text as it travels in the batch header."""
        return REPLACE_MARK + self.reason if self.replace and not is_replace(self.reason) else self.reason


REPLACE_MARK = "[replace] "
"""Prefix of a drop marker whose ticket the scheduler replaces (see `Drop.replace`)."""


def is_replace(marker: str | None) -> bool:
    return bool(marker) and marker.startswith(REPLACE_MARK)


@dataclass
class NodeContext:
    """What a running node knows about where it runs. Given to the node's constructor."""

    name: str
    kind: str
    replica: int
    replicas: int
    seed: int
    device: str
    """torch device string for this process: `cpu` or `cuda:0` (local id after CUDA_VISIBLE_DEVICES)."""
    devices: list[int]
    """Physical ids of this replica's devices (GPU ids, or CPU core ids on a CPU-only machine)."""
    dtype: str
    rank: int = 0
    world_size: int = 1
    run_dir: Path | None = None
    graph: Any = None
    """The resolved GraphSpec (read-only)."""
    recorder: Any = None
    """`flowrl.metrics.Recorder` of this process: counters, means, spans."""
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("flowrl.node"))
    policy_version: int = 0
    """Version of the weights this process holds (subscribers) or has published (trainers)."""
    services: dict[str, Any] = field(default_factory=dict)
    """Service name (the server node) -> a `flowrl.agents.base.Generator`, for each
    `services: [this node -> server]` of the graph (an agent's rollout)."""


class Node:
    """Base class of every node. Override `process` (and `setup`/`teardown` when needed)."""

    inputs: ClassVar[tuple[str, ...]] = ("in",)
    outputs: ClassVar[tuple[str, ...]] = ("out",)
    Config: ClassVar[type[NodeConfig]] = NodeConfig
    role: ClassVar[str | None] = None
    """Placement role: `actor`, `critic`, `rollout`, `reference`, `reward` or None (no rules)."""
    stateful: ClassVar[bool] = False
    publishes_weights: ClassVar[bool] = False
    subscribes_weights: ClassVar[bool] = False
    requires: ClassVar[dict[str, str | None]] = {}
    """Tensors every input batch must carry: name -> dtype (`int64`, `float32`, ...; None: any),
    either layout; `"ragged int64"` takes only a `Ragged` tensor (one sequence per sample) and
    `"dense int64"` only a rectangular one.
    A batch without them is rejected at the node's boundary and counted (`batches_rejected`),
    never handed to `process`: a forged or garbled batch cannot crash or restart the node."""
    preload: ClassVar[tuple[str, ...]] = ("torch", "torch._dynamo")
    """Modules the local fork server imports once, before it forks any node process, so that
    neither this node's first start nor a restart of it imports them again (`torch` costs ~1.5 s on
    a small CPU, `torch._dynamo`, which the first optimizer step imports, ~2 s more). A node that
    never touches torch says `()`; one that loads a Hugging Face model adds `"transformers"`. The
    runtime adds `torch` itself where it uses it: a stateful node's checkpoints, a torch.distributed
    group (weights, ranks)."""
    merge_replicas: ClassVar[str | None] = None
    """Stateful nodes only: how the states of several replicas merge. None (the default) means
    replicas are refused by `flowrl check`; use `devices: N` for data-parallel training."""

    def __init__(self, config: NodeConfig, ctx: NodeContext):
        self.config = config
        self.ctx = ctx

    async def setup(self) -> None:
        """Load models, allocate buffers. Runs once per process, before READY is reported."""

    async def process(self, batch: "Batch", port: str) -> "Batch | dict[str, Batch] | None":
        """Handle one batch from input `port`. Return a batch (sent on the only output port), a
        dict {port: batch}, or None (nothing to send)."""
        raise NotImplementedError(f"{type(self).__name__} must implement process()")

    async def teardown(self) -> None:
        """Release resources. Runs on a clean stop (not after a crash)."""

    # colocated nodes that take turns (`take_turns`, docs/colocation.md) -----------------------
    async def sleep(self) -> None:
        """Another node colocated on the same devices takes its turn: release the memory this
        node can rebuild (an engine's KV cache and weights, a trainer's parameters and optimizer
        state to host memory or a file). Called between two calls, never during one."""

    async def wake(self) -> None:
        """This node's turn begins: restore what `sleep` released, exactly (same values). Called
        before the next call, state load or save; also after setup without a `sleep` before it."""

    # stateful nodes -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    # weight publishers / subscribers --------------------------------------------------------
    def weights(self) -> dict[str, Any]:
        """Publishers: the named tensors to send after an update (the runtime snapshots them).
        Subscribers: the live tensors to overwrite — the runtime receives the new version straight
        into them (between batches, never during `process`). Same names, shapes and dtypes on
        both sides; a mismatch is reported when the sync group forms."""
        raise NotImplementedError(f"{type(self).__name__} takes part in weight sync but has no weights()")

    def load_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Subscribers: called once `weights()` holds `version` (e.g. to rebuild caches).

        A subscriber with `concurrency` (calls in flight while a version arrives) may also define
        `async def before_weights(self, version)`, awaited on the compute thread before the tensors
        change (stop between two generation steps), and `def weights_failed(self, version)`, called
        instead of `load_weights` when the version did not land (go on as before); the rollout's
        continuous engines use both (docs/recovery.md#groups-and-calls-in-flight)."""


class Source(Node):
    """A node that creates work from tickets instead of receiving batches."""

    inputs = ()

    async def generate(self, ticket: Ticket) -> "Batch":
        raise NotImplementedError(f"{type(self).__name__} must implement generate()")


class Sink(Node):
    """A node that consumes batches. A ticket counts as consumed once every sink has processed it;
    a sink that trains reports the new policy version by returning from `process`."""

    outputs = ()


class Observer(Node):
    """A node with no data ports that watches the policy: it subscribes to a trainer's weights and
    `observe(version)` runs after each new version is loaded (versions that arrive while it is
    busy are skipped). Evaluation loops are observers."""

    inputs = ()
    outputs = ()
    subscribes_weights = True

    async def observe(self, version: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement observe()")


class Join(Node):
    """A node with several inputs: batches with the same `batch_id` are gathered from every input
    port, then `join` is called once with all of them."""

    inputs = ("a", "b")

    async def join(self, batches: dict[str, "Batch"]) -> "Batch | dict[str, Batch] | None":
        raise NotImplementedError(f"{type(self).__name__} must implement join()")

    async def process(self, batch, port):  # pragma: no cover - the runtime calls join()
        raise RuntimeError("Join.process is not called; the runtime gathers inputs and calls join()")
