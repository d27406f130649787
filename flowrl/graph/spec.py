"""The graph file as typed models: what nodes exist, where they run and how data flows.

A graph file is YAML; `flowrl.graph.load_graph` turns it into a `GraphSpec`. The same graph can be
built in Python::

    from flowrl.graph import GraphSpec, NodeSpec
    g = GraphSpec(
        name="pipe",
        nodes={"src": NodeSpec(kind="mypkg.nodes:Numbers"), "sink": NodeSpec(kind="mypkg.nodes:Sum")},
        edges=["src -> sink"],
        schedule={"steps": 10},
    )

Every model rejects unknown keys, so a typo fails at load time with the file and line.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal, Union

from pydantic import Field, field_validator, model_validator

from flowrl.schema import StrictModel

DTYPES = ("float32", "bfloat16", "float16")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENDPOINT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?\s*$")


class FailurePolicy(StrictModel):
    """What the controller does when a replica of this node dies or hangs."""

    policy: Literal["restart", "fail"] = "restart"
    """`restart`: start a new process and replay the node's in-flight work; `fail`: end the run."""
    max_restarts: int = Field(3, ge=0)
    """Restart budget per replica; one more failure than this fails the run."""
    backoff_s: float = Field(0.2, ge=0)
    """Wait before the first restart; doubles with each further restart of the same replica."""


class NodeSpec(StrictModel):
    """One node of the graph: a role process (or several replicas of it) on its own devices."""

    kind: str
    """A built-in node (`rollout`, `actor`, ...) or an import path `package.module:Class`."""
    replicas: int = Field(1, ge=1)
    """Independent copies of the node; work is spread over them (data parallel across processes)."""
    devices: Union[Literal["auto"], int, list[Union[int, str]]] = "auto"
    """`auto` (the planner picks), a count per replica, or the node's explicit device list, split
    evenly over its replicas. Entries are device ids on `host`, or `"host:id"` strings. On a
    machine without GPUs the devices are CPU cores."""
    mesh: list[int] | None = None
    """Shape of each replica's device group, e.g. `[2, 2]` for data x tensor parallel; the product
    must equal the devices per replica. Default: a flat group."""
    host: str | None = None
    """Host to place this node on (multi-host inventories). Default: the planner chooses."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the node; nodes that exchange tensors must agree."""
    colocate_with: list[str] = Field(default_factory=list)
    """Nodes this one may share devices with (declares intended colocation)."""
    take_turns: bool = False
    """With `colocate_with`: the colocated nodes take turns on their devices (a hybrid engine:
    generate, then train) instead of running side by side. The one waiting releases its memory
    (engine sleep, trainer offload), and `flowrl check` counts the larger turn, not the sum. One
    member saying so makes its whole colocation group take turns."""
    model_size: Union[int, float, str, None] = None
    """Parameters of the node's model for `flowrl check`'s memory model, when its config cannot say
    (e.g. the model folder is on the cluster, not here): `72B`, `7.6B`, `500M` or a number. Read as
    a parameter count; nothing at run time uses it."""
    on_failure: FailurePolicy = Field(default_factory=FailurePolicy)
    concurrency: int = Field(1, ge=1, le=4096)
    """Batches the node works on at once (a rollout whose engine batches continuously: several
    tickets share its iterations). The runtime runs up to this many calls of the node together on its
    compute thread's asyncio loop, each under the usual input policies (fence, version gate, once);
    stateless, single-rank nodes only. Its input edges get at least `2 x concurrency` credits."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The node's own config, validated against the node class's `Config` model."""
    fuse_into: str | None = None
    """Run this node inside the named node's process, as part of that node's call, instead of in a
    process of its own (flowrl.graph.fusion): `fuse_into: rollout` on a reward node that scores the
    rollout's output. For light, stateless steps (a rule-based reward, group advantages): no
    channel, no process, no message between the two. The node keeps its name, kind, config and
    dtype; it runs on the other node's devices, replicas and restarts."""
    fused: dict[str, "NodeSpec"] = Field(default_factory=dict)
    """The nodes fused into this one, in the order their calls follow its own: written by the graph
    check from `fuse_into` (the run directory's graph.yaml holds it); declare `fuse_into` instead."""

    @field_validator("devices")
    @classmethod
    def _devices_valid(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError(f"device count must be >= 1, got {v}")
        if isinstance(v, list):
            if not v:
                raise ValueError("device list is empty; give ids, a count, or `auto`")
            for d in v:
                if isinstance(d, int) and d < 0:
                    raise ValueError(f"device id {d} is negative")
                if isinstance(d, str) and not re.match(r"^[^:\s]+:\d+$", d):
                    raise ValueError(f"device {d!r} is neither an id nor 'host:id'")
            if len(set(map(str, v))) != len(v):
                raise ValueError(f"device list {v} names a device twice")
        return v

    @field_validator("model_size", mode="before")
    @classmethod
    def _size_valid(cls, v):
        if v is None:
            return v
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([kKmMbBtT]?)\s*", str(v)) if not isinstance(v, bool) else None
        n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()] if m else 0
        if not (1 <= n < 1e16):
            raise ValueError(f"model_size {str(v)[:40]!r} must be a parameter count like 72B, 7.6B, 500M or 72e9")
        return int(n)

    @field_validator("fuse_into")
    @classmethod
    def _fuse_into_valid(cls, v):
        if v is not None and not _ENDPOINT.match(v):
            raise ValueError(f"fuse_into {str(v)[:60]!r} is not a node name (or NODE.PORT)")
        return v.strip() if v is not None else v

    @field_validator("mesh")
    @classmethod
    def _mesh_valid(cls, v):
        if v is not None and (not v or any(d < 1 for d in v)):
            raise ValueError(f"mesh {v} must be a non-empty list of positive sizes, e.g. [2, 2]")
        return v


class EdgeSpec(StrictModel):
    """A data channel `producer[.port] -> consumer[.port]`. Written as a string or a mapping."""

    src: str
    dst: str
    src_port: str | None = None
    """Output port of the producer; default: its only output port."""
    dst_port: str | None = None
    """Input port of the consumer; default: its only input port."""
    capacity: int = Field(4, ge=1)
    """Credits: messages the consumer accepts ahead of processing (bounds memory on this edge)."""
    capacity_bytes: int = Field(1 << 30, ge=1)
    """Bytes the consumer accepts ahead of processing."""

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, v):
        if isinstance(v, str):
            v = {"from": v.split("->", 1)[0], "to": v.split("->", 1)[1]} if "->" in v else {"bad": v}
        if isinstance(v, dict) and ("from" in v or "to" in v or "bad" in v):
            v = dict(v)
            if "bad" in v:
                raise ValueError(f"edge {v['bad']!r} has no '->'; write 'producer.port -> consumer.port'")
            for key, side in (("from", "src"), ("to", "dst")):
                text = v.pop(key, None)
                if text is None:
                    raise ValueError(f"edge needs `{key}:`")
                m = _ENDPOINT.match(str(text))
                if not m:
                    raise ValueError(f"edge endpoint {text!r} is not 'node' or 'node.port'")
                v[side], v[side + "_port"] = m.group(1), m.group(2)
        return v

    def __str__(self) -> str:
        a = self.src + (f".{self.src_port}" if self.src_port else "")
        b = self.dst + (f".{self.dst_port}" if self.dst_port else "")
        return f"{a} -> {b}"


class _Arrow(StrictModel):
    """`src -> dst`, written as a string: a weight edge or a service."""

    src: str
    dst: str
    _reads: ClassVar[str] = "'src -> dst'"
    _what: ClassVar[str] = "arrow"

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, v):
        if isinstance(v, str):
            parts = [p.strip() for p in v.split("->")]
            if len(parts) != 2 or not all(_NAME.match(p) for p in parts):
                raise ValueError(f"{cls._what} {v!r} must read {cls._reads}")
            return {"src": parts[0], "dst": parts[1]}
        return v

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}"


class WeightEdgeSpec(_Arrow):
    """Weights flow from a trainer to its subscribers: `actor -> rollout`."""

    _reads = "'trainer -> subscriber'"
    _what = "weight edge"


class ServiceSpec(_Arrow):
    """A request/reply path beside the data edges: `agent -> rollout` lets every replica of `agent`
    ask the replicas of `rollout` for completions (sticky per session, least-loaded across
    replicas, retried elsewhere when a replica dies). The server is a node with an async `serve`
    hook (the built-in rollout); the client reaches it as `ctx.services["rollout"]`. Services carry
    no tickets: exactly-once stays with the data edges."""

    _reads = "'client -> server' (e.g. 'agent -> rollout')"
    _what = "service"

    @property
    def name(self) -> str:
        """The route's name in wiring orders (`service:<server>`)."""
        return f"service:{self.dst}"


class ScheduleSpec(StrictModel):
    """How much work the scheduler issues and how far rollout may run ahead of training."""

    steps: int = Field(100, ge=1)
    """Training updates before the run ends."""
    batch_size: int = Field(8, ge=1)
    """Prompts per training update."""
    ticket: Literal["batch", "group"] = "batch"
    """The unit of work the scheduler issues and the exactly-once ledger counts. `batch`: one ticket
    is `batch_size` prompts and feeds one update. `group`: one ticket is one prompt (its group of
    samples), so a group leaves the rollout as soon as its samples are done and flows on by itself;
    a trainer's update takes the `batch_size` groups of its tickets, in ticket order
    (docs/recovery.md#groups)."""
    max_staleness: int = Field(0, ge=0)
    """k: a sample used by update n was generated with weights of version >= n - k.
    0 is synchronous on-policy; k >= 1 overlaps generation with training (k + 1 updates' tickets in
    flight). With `ticket: group` it holds per group, on its oldest generated token."""
    ticket_timeout_s: float = Field(120.0, gt=0)
    """A ticket not consumed this long after issue is re-issued (lost message, stuck node)."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint stateful nodes + ledger every N steps (0: only at the start and the end). A
    crash of a stateful node replays at most this many steps."""
    keep_checkpoints: int = Field(2, ge=1)
    """Committed checkpoints kept on disk; older ones are deleted."""
    max_attempts: int = Field(10, ge=1)
    """A ticket issued this many times (first try included) without reaching every sink fails the
    run with an error naming the ticket, where it was stuck and the last error."""
    max_replaced: int | None = Field(None, ge=0)
    """Most tickets added in place of tickets dropped with `replace=True` (a DAPO filter holding
    groups for a fuller batch); None: 10 x `steps`. Past it a replace drop is a plain drop (a warning
    and a `replace_refused` ledger row: the run makes one update fewer)."""

    @property
    def tickets_per_update(self) -> int:
        """Tickets one training update takes: `batch_size` groups, or one batch."""
        return self.batch_size if self.ticket == "group" else 1

    @property
    def ticket_size(self) -> int:
        """Prompts per ticket."""
        return 1 if self.ticket == "group" else self.batch_size

    @property
    def total_tickets(self) -> int:
        """Tickets the run issues (before replacements): `steps` updates' worth."""
        return self.steps * self.tickets_per_update

    @property
    def checkpoint_every_tickets(self) -> int:
        """`checkpoint_every` updates in tickets (a checkpoint always falls between two updates)."""
        return self.checkpoint_every * self.tickets_per_update


class SupervisionSpec(StrictModel):
    """Liveness: how often nodes say they are alive and when silence counts as a hang."""

    heartbeat_s: float = Field(0.5, gt=0)
    deadline_s: float = Field(5.0, gt=0)
    """A replica silent this long is declared hung and handled by its failure policy."""
    process_timeout_s: float = Field(600.0, gt=0)
    """One call into a node (`process`, `generate`, `join`, a weight sync) running longer than this
    means the node is hung (a wedged collective, a driver call, a bug): it is restarted by policy."""
    startup_timeout_s: float = Field(120.0, gt=0)
    """A replica that has not reported READY this long after start has failed to start."""
    stop_timeout_s: float = Field(5.0, gt=0)
    """Grace between SIGTERM and SIGKILL at teardown."""
    peer_timeout_s: float = Field(300.0, gt=0)
    """How long a node's data channels wait for a peer that went silent (a consumer that died and is
    being restarted) before giving up on it. Long on purpose: the supervision deadline, not the
    channel, decides when a node is lost. Carried to each node process in its process spec."""


class TicketDeskSpec(StrictModel):
    """The controller's ticket desk: sending tickets and telling nodes how far the run is."""

    progress_interval_s: float = Field(0.25, gt=0)
    """Least time between two `Progress` messages (which tickets are complete) to every node; a
    change of the run's end goes out at once."""


class WeightSyncSpec(StrictModel):
    """The controller's weight-sync group: sync epochs and Sync orders."""

    max_failures: int = Field(5, ge=0)
    """Sync rounds of the current epoch that may fail in a row (each forms a new epoch); one more
    fails the run."""
    min_timeout_s: float = Field(30.0, gt=0)
    """Least timeout of each collective of a sync (forming the group, the broadcast)."""
    timeout_deadlines: float = Field(4.0, gt=0)
    """A sync's collective timeout in supervision deadlines (`supervision.deadline_s`), when that
    is longer than `min_timeout_s`."""


class RecoverySpec(StrictModel):
    """The controller's recovery epochs (the deadline is `supervision.startup_timeout_s`)."""

    epoch_resend_s: float = Field(2.0, gt=0)
    """While a recovery runs, the `Epoch` order goes again this often to every process that has
    not entered the epoch (a lost message, a process that was starting)."""


class ControllerSpec(StrictModel):
    """The controller's own loop and the sections of its components."""

    tick_s: float = Field(0.05, gt=0)
    """Control loop period: supervision, ticket flushes and progress run once per tick."""
    final_checkpoint_wait_s: float = Field(60.0, ge=0)
    """At the end of a run with stateful nodes, how long to wait for the final checkpoint to commit
    (a finished run can then be extended with `--resume`)."""
    tickets: TicketDeskSpec = Field(default_factory=TicketDeskSpec)
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)


class LauncherSpec(StrictModel):
    """Who starts node processes: `local` subprocesses, or Ray actors (`ray`, docs/multi-host.md)."""

    type: Literal["local", "subprocess", "ray"] = "local"
    """`local`: forked from a server with torch imported (fast restarts); `subprocess`: a fresh
    interpreter per node; `ray`: each node process under a Ray actor pinned to its planned host."""
    address: str | None = None
    """Ray cluster (`ray` only): `auto` (the one on this machine), its GCS `HOST:PORT`, or null to
    start a private one on 127.0.0.1 for the run."""
    curve: bool = True
    """CURVE (encryption + per-process keys) on the tcp channels and control between hosts (ray,
    docs/multi-host.md). Turn it off only inside a network you trust: the per-run secret then
    still keeps strangers out, but batches travel in the clear."""
    host_dirs: dict[str, str] = Field(default_factory=dict)
    """Run folders of hosts that do not share the run directory (`ray`, docs/multi-host.md):
    `{HOST: FOLDER}`. A process planned on a listed host keeps its files (logs, pid file,
    checkpoint shards, the graph's copy) in `FOLDER/<run directory's name>` on that host; hosts not
    listed use the run directory itself (a shared filesystem). The controller's own files (ledger,
    metrics, plan, commit records) stay in the run directory on its host; a shard that a process
    needs on another host is fetched through the launcher, its sha256 checked."""
    checkpoint_uri: str | None = None
    """A folder every host can reach (a mounted bucket, NFS): each process also copies its
    checkpoint shard to `checkpoint_uri/<run directory's name>/checkpoints/...` when it saves, and a
    shard whose host is gone is fetched from there (docs/multi-host.md)."""


class MetricsSpec(StrictModel):
    """Metric sinks beside RUN_DIR/metrics.jsonl (and Prometheus, `flowrl run --metrics-port`)."""

    tensorboard: bool = False
    """Write every row as TensorBoard scalars to RUN_DIR/tensorboard/ (pip install 'flowrl[logging]')."""
    wandb: bool = False
    """Log every row to Weights & Biases, into RUN_DIR/wandb/ (pip install 'flowrl[logging]')."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline` never touches the network (upload later with `wandb sync RUN_DIR/wandb/offline-run-*`)."""
    wandb_project: str = "flowrl"


class GraphSpec(StrictModel):
    """A whole graph file."""

    name: str = "graph"
    seed: int = 0
    """Seeds every node (model initialisation, sampling, data): same seed, same run."""
    vars: dict[str, Any] = Field(default_factory=dict)
    """Free-form values for YAML anchors shared by several nodes (`model: &model {...}`)."""
    nodes: dict[str, NodeSpec]
    edges: list[EdgeSpec] = Field(default_factory=list)
    weights: list[WeightEdgeSpec] = Field(default_factory=list)
    services: list[ServiceSpec] = Field(default_factory=list)
    """Request/reply paths (`agent -> rollout`): see `ServiceSpec`."""
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    supervision: SupervisionSpec = Field(default_factory=SupervisionSpec)
    controller: ControllerSpec = Field(default_factory=ControllerSpec)
    """Tuning of the controller's loop, ticket desk, weight-sync group and recovery."""
    launcher: LauncherSpec = Field(default_factory=LauncherSpec)
    faults: list[str] = Field(default_factory=list)
    """Fault-injection specs (same language as `flowrl run --fault`)."""
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    """Extra metric sinks: `metrics: {tensorboard: true, wandb: true}` (or `metrics.tensorboard=true`)."""

    @field_validator("nodes")
    @classmethod
    def _names_valid(cls, v):
        if not v:
            raise ValueError("a graph needs at least one node")
        for name in v:
            if not _NAME.match(name):
                raise ValueError(f"node name {name!r} must be an identifier (letters, digits, _)")
        return v

    def node(self, name: str) -> NodeSpec:
        return self.nodes[name]

    def edge_capacity(self, edge: EdgeSpec) -> int:
        """Credits of `edge`: its own, and at least twice (each producer link may hold half of an
        input's credit) its consumer's `concurrency` (one producer can keep every call busy) and,
        with `ticket: group`, the groups the scheduler lets be in flight, `(max_staleness + 1) x
        batch_size`: a producer then never waits for credit while its consumer waits for it in a
        weight sync (a trainer publishing to a rollout that still sends it the groups of an update).
        Batch tickets keep the edge's own credit, so work queued at one replica stays small."""
        node = self.nodes.get(edge.dst)
        sched = self.schedule
        groups = (sched.max_staleness + 1) * sched.tickets_per_update if sched.ticket == "group" else 0
        return max(edge.capacity, 2 * groups, 2 * (node.concurrency if node is not None else 1))
