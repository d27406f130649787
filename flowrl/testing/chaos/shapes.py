"""Random graph shapes of synthetic nodes, seeded: chains, fan-out, joins, 1-3 sinks, stateful
transforms, drops, shrinking filters and replicas of stateless nodes; with `ranks=True`, nodes of
2-3 data-parallel ranks whose `process` runs a collective, and a weight-publishing data-parallel
sink with a subscriber.

    shape = random_shape(seed=7)
    print(shape.describe())        # src -> mix(x2) -> fold* -> {sink*, log}
    spec = shape.graph(features)   # a flowrl.GraphSpec (short heartbeats and timeouts)

A shape grows from its source: each new node consumes one open output (a chain link), an output
that already has a consumer (a fan-out: two edges from one port broadcast), or two outputs (a join);
then every open output gets a sink, and extra sinks hang off random nodes. Every input port has
exactly one edge, so the graph is a DAG whose every path ends in a sink.

`ranks=True` adds the data-parallel kinds (`RMix`, `RFold` transforms, `RFoldSink` sinks, 2-3 ranks
each, at least one per shape) and, in half of the shapes, makes the first sink an `RTrainer` (it
publishes weights, gathered on every rank) with a subscriber (`Sub`, or `RSub` with ranks of its
own) on a random edge or on the trainer's input, and half the time a `Drop` filter (1-2 replicas)
right before the trainer, as in PPO / DAPO.
`scale=True` makes sure the shape has a stateless node that `flowrl scale` can scale (a `Mix` on a
random edge if it had none). Without them a seed gives the same graph as it always did.

Half of the shapes (a stream of the seed's own, `concurrency=True/False` forces it) give some
stateless single-rank nodes `concurrency: 2..6` (`NodeDef.concurrency`; their calls overlap,
`nodes.Overlapping`); with `groups=True`, half of the shapes without `Hold` use
`schedule.ticket: group` (`Shape.groups`: one-sample tickets, a stateful sink takes an update's
tickets in one call). Neither changes the graph, steps or checkpoints a seed gave before, and
concurrency changes no schedule.

Half of the shapes (a stream of the seed's own, `fusion=True/False` forces it; never in shapes
made for scale events) run some stateless transforms inside their producer's process
(`fuse_into`, `NodeDef.fuse_into`; faults target the processes, so the host's faults are theirs).
Nothing else about the shape changes, and the model's results do not depend on it.

Half of the shapes are ragged (`Shape.ragged`, the seed's last draw, so a seed's graph does not
depend on it; `ragged=True` / `False` forces it): the source's batches carry a
`flowrl.Ragged` `r` next to `x` (`nodes.ragged_of`), and every stateful node and sink is configured
`ragged: true`, so it requires `r` and checks it against `x` for every batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from flowrl.testing.chaos.features import Features
from flowrl.testing.chaos.nodes import KINDS

RAGGED_CONFIG = ("TicketSource", "Hold", "Fold", "FoldSink", "LogSink", "RFold", "RFoldSink", "RTrainer")
"""Classes configured `ragged: true` in a ragged shape: the source makes `r`, the others require it."""
STATELESS = ("Mix", "Drop", "Shrink", "LogSink", "TicketSource", "RMix", "Sub", "RSub")
REPLICABLE = ("Mix", "Drop", "Shrink", "LogSink", "Sub")
"""Stateless nodes that may have replicas, and so be scaled (`flowrl scale`) while a run goes on."""
CONCURRENT = ("TicketSource", "Mix", "Drop", "Shrink", "Merge", "LogSink", "Sub")
"""Stateless single-rank classes that may get `concurrency: 2..6` (their calls overlap: `nodes.Overlapping`)."""
LINGER_S = 0.05
"""How long a call of a concurrent node waits for another to be in flight with it (`linger_s`)."""
RANKED = ("RMix", "RFold", "RFoldSink", "RTrainer", "RSub")
"""Data-parallel classes: `devices: ranks` (2-3), a collective inside `process`."""
SCALE_STEPS, SCALE_PACE_S, SCALE_BURST = 20, 0.5, 4
"""Shapes made for scale events run at least this many tickets, one per this many seconds on average,
in bursts (several tickets in flight at once, as without a pace: a data-parallel node's in-order
buffer still releases several at once)."""


@dataclass
class NodeDef:
    name: str
    cls: str
    inputs: dict[str, str] = field(default_factory=dict)
    """Input port -> producer node."""
    config: dict = field(default_factory=dict)
    replicas: int = 1
    ranks: int = 1
    """Data-parallel ranks per replica (`devices: ranks`): one process each, one gloo group."""
    concurrency: int = 1
    """Calls of one process in flight at once (`concurrency`; stateless, single-rank nodes only)."""
    fuse_into: str | None = None
    """Its producer, when it runs inside the producer's process (`fuse_into`; see `_with_fusion`)."""

    @property
    def stateful(self) -> bool:
        return self.cls in ("Fold", "FoldSink", "Hold", "RFold", "RFoldSink", "RTrainer")

    @property
    def sink(self) -> bool:
        return self.cls in ("FoldSink", "LogSink", "RFoldSink", "RTrainer")

    @property
    def scalable(self) -> bool:
        """`flowrl scale` may change its replicas (stateless, one rank, a process of its own)."""
        return self.cls in REPLICABLE and self.ranks == 1 and self.fuse_into is None


@dataclass
class Timing:
    """Supervision and schedule knobs of a shape's graph: short, so that faults resolve fast."""

    heartbeat_s: float = 0.2
    deadline_s: float = 2.0
    process_timeout_s: float = 3.0
    ticket_timeout_s: float = 4.0
    max_attempts: int = 6
    keep_checkpoints: int = 2
    max_restarts: int = 3
    backoff_s: float = 0.1
    startup_timeout_s: float = 60.0


@dataclass
class Shape:
    seed: int
    nodes: dict[str, NodeDef]
    """In topological order (every producer before its consumers)."""
    steps: int
    batch_size: int
    checkpoint_every: int
    max_staleness: int
    timing: Timing = field(default_factory=Timing)
    pace_s: float = 0.0
    """Seconds per ticket the source takes on average, in bursts of `SCALE_BURST` (0: no pace;
    shapes for scale events)."""
    ragged: bool = False
    """Batches carry a ragged `r` next to `x` (see the module docstring)."""
    groups: bool = False
    """`schedule.ticket: group`: a ticket is one prompt, `steps` updates of `batch_size` tickets
    each; a stateful sink takes the tickets of one update in one call, their batches concatenated
    (`checkpoint_every` counts updates)."""

    @property
    def tickets_per_update(self) -> int:
        return self.batch_size if self.groups else 1

    @property
    def ticket_size(self) -> int:
        """Samples per ticket from the source."""
        return 1 if self.groups else self.batch_size

    @property
    def tickets(self) -> int:
        """Tickets the run issues before replacements (`steps` updates' worth)."""
        return self.steps * self.tickets_per_update

    @property
    def checkpoint_tickets(self) -> int:
        """Tickets between two checkpoints (`checkpoint_every` updates)."""
        return self.checkpoint_every * self.tickets_per_update

    @property
    def sinks(self) -> list[str]:
        return [n for n, d in self.nodes.items() if d.sink]

    @property
    def stateful(self) -> list[str]:
        return [n for n, d in self.nodes.items() if d.stateful]

    @property
    def running(self) -> list[str]:
        """The nodes with processes of their own: what a fault can target (not the fused ones)."""
        return [n for n, d in self.nodes.items() if d.fuse_into is None]

    def consumers(self, name: str) -> list[str]:
        return [d.name for d in self.nodes.values() if name in d.inputs.values()]

    @property
    def processes(self) -> int:
        return sum(d.replicas * d.ranks for d in self.nodes.values())

    @property
    def state_keys(self) -> list[str]:
        """Every state the final checkpoint must hold: one per stateful node, one per rank of a
        data-parallel one (`node`, `node/rank1`, ...; see `nodes.rank_state_key`)."""
        from flowrl.testing.chaos.nodes import rank_state_key

        return [rank_state_key(n, r) for n, d in self.nodes.items() if d.stateful for r in range(d.ranks)]

    @property
    def publisher(self) -> str | None:
        return next((n for n, d in self.nodes.items() if d.cls == "RTrainer"), None)

    @property
    def scalable(self) -> list[str]:
        return [n for n, d in self.nodes.items() if d.scalable]

    def traits(self) -> list[str]:
        """What makes this shape more than a chain with one sink (for breakdowns of results)."""
        ds = list(self.nodes.values())
        out = []
        if len(self.sinks) > 1:
            out.append("several sinks")
        if any(d.cls == "LogSink" for d in ds):
            out.append("stateless sink")
        if any(d.sink and d.replicas > 1 for d in ds):
            out.append("replicated sink")
        if any(d.cls == "Fold" for d in ds):
            out.append("stateful transform")
        if any(d.cls == "Merge" for d in ds):
            out.append("join")
        if any(d.cls == "Drop" for d in ds):
            out.append("drops")
        if any(d.cls == "Shrink" for d in ds):
            out.append("shrinks")
        if any(d.cls == "Hold" for d in ds):
            out.append("replaced tickets")
        if any(len(self.consumers(n)) > 1 for n in self.nodes):
            out.append("fan-out")
        if any(d.replicas > 1 and not d.sink for d in ds):
            out.append("replicas")
        if any(d.ranks > 1 for d in ds):
            out.append("data parallel")
        if any(d.ranks > 1 and d.stateful for d in ds):
            out.append("data-parallel state")
        if any(d.cls == "RTrainer" for d in ds):
            out.append("weight sync")
        if any(d.cls == "RSub" for d in ds):
            out.append("data-parallel subscriber")
        if self.ragged:
            out.append("ragged")
        if any(d.concurrency > 1 for d in ds):
            out.append("concurrent")
        if self.groups:
            out.append("groups")
        if any(d.fuse_into for d in ds):
            out.append("fused")
        return out or ["chain, one sink"]

    def edges(self) -> list[str]:
        out = []
        for d in self.nodes.values():
            for port, src in d.inputs.items():
                out.append(f"{src} -> {d.name}.{port}" if d.cls == "Merge" else f"{src} -> {d.name}")
        return out

    def describe(self) -> str:
        """One line per node: `name Class(xR)* <- inputs` (* = stateful)."""
        lines = [(f"shape {self.seed}: {self.steps} steps x {self.batch_size}, checkpoint every "
                  f"{self.checkpoint_every}, max_staleness {self.max_staleness}"
                  + (f", {SCALE_BURST} tickets per {self.pace_s * SCALE_BURST:g} s" if self.pace_s else "")
                  + (RAGGED_MARK if self.ragged else ""))]
        if self.groups:  # the first line says updates, not tickets
            lines[0] = lines[0].replace(f"{self.steps} steps x {self.batch_size}", GROUPS_MARK.format(
                steps=self.steps, g=self.batch_size, tickets=self.tickets))
        for d in self.nodes.values():
            rep = f" x{d.replicas}" if d.replicas > 1 else ""
            rep += f" ({d.ranks} ranks)" if d.ranks > 1 else ""
            rep += CONCURRENCY_MARK.format(d.concurrency) if d.concurrency > 1 else ""
            rep += FUSED_MARK.format(d.fuse_into) if d.fuse_into else ""
            star = "*" if d.stateful else ""
            src = ", ".join(f"{p}={s}" for p, s in d.inputs.items()) if d.cls == "Merge" else ", ".join(d.inputs.values())
            lines.append(f"  {d.name:<8} {d.cls}{star}{rep}" + (f" <- {src}" if src else ""))
        return "\n".join(lines)

    def graph(self, features: Features | None = None):
        """The shape as a `flowrl.GraphSpec`; knobs the runtime lacks (`features`) are left out."""
        from flowrl.graph import GraphSpec

        features = features or Features.detect()
        t = self.timing
        schedule = {"steps": self.steps, "batch_size": self.batch_size, "max_staleness": self.max_staleness,
                    "ticket_timeout_s": t.ticket_timeout_s, "checkpoint_every": self.checkpoint_every}
        if self.groups:
            schedule["ticket"] = "group"
        supervision = {"heartbeat_s": t.heartbeat_s, "deadline_s": t.deadline_s,
                       "startup_timeout_s": t.startup_timeout_s, "stop_timeout_s": 2.0}
        if any(d.cls == "Hold" for d in self.nodes.values()):  # the model's bound on added tickets
            schedule["max_replaced"] = self.steps
        if features.max_attempts:
            schedule["max_attempts"] = t.max_attempts
        if features.keep_checkpoints:
            schedule["keep_checkpoints"] = t.keep_checkpoints
        if features.process_timeout:
            supervision["process_timeout_s"] = t.process_timeout_s
        pace = {"pace_s": self.pace_s, "burst": SCALE_BURST} if self.pace_s else {}
        nodes = {d.name: {"kind": KINDS[d.cls], "config": {**d.config, **(pace if d.cls == "TicketSource" else {})},
                          **({"fuse_into": d.fuse_into} if d.fuse_into else {  # a fused node has its host's
                              "replicas": d.replicas,
                              "on_failure": {"policy": "restart", "max_restarts": t.max_restarts,
                                             "backoff_s": t.backoff_s}}),
                          **({"devices": d.ranks} if d.ranks > 1 else {}),
                          **({"concurrency": d.concurrency} if d.concurrency > 1 else {})}
                 for d in self.nodes.values()}
        weights = [f"{d.name} -> {s.name}" for d in self.nodes.values() if d.cls == "RTrainer"
                   for s in self.nodes.values() if s.cls in ("Sub", "RSub")]
        return GraphSpec.model_validate({"name": f"shape{self.seed}", "seed": self.seed, "nodes": nodes,
                                         "edges": self.edges(), "weights": weights, "schedule": schedule,
                                         "supervision": supervision})


def random_shape(seed: int, *, min_nodes: int = 3, max_nodes: int = 8, max_processes: int = 10,
                 steps: tuple[int, int] = (10, 30), drops: bool = True, holds: bool = False,
                 ranks: bool = False, scale: bool = False, ragged: bool | None = None,
                 concurrency: bool | None = None, groups: bool = False, fusion: bool | None = None) -> Shape:
    """A random shape (the same for the same seed and options). `drops=False` leaves out `Drop`
    filters; `holds=True` adds `Hold` nodes (tickets dropped with replace=True, like a DAPO
    filter's); `ranks=True` adds data-parallel nodes with collectives (and, in half the shapes, a
    weight-publishing data-parallel sink with a subscriber); `scale=True` makes sure a node can be
    scaled. `max_processes` counts every rank of every replica. `ragged`: batches carry a ragged
    `r` (None: drawn from the seed, for half of them, after everything else, so the graph is the same
    either way). `concurrency`: some stateless nodes get `concurrency: 2..6` (None: in half of the
    shapes, drawn from a stream of their own, so graph, steps and ragged stay what they were;
    True: in every shape that has such a node; False: never). `groups=True`: half of the shapes
    without a `Hold` node (their own draw) use `schedule.ticket: group` (see `_with_groups`).
    `fusion`: some stateless transforms run inside their producer's process (`fuse_into`; None: in
    half of the shapes, a stream of their own; see `_with_fusion`)."""
    rng = random.Random(seed)
    while True:
        shape = _grow(rng, seed, min_nodes, max_nodes, drops, holds, ranks, scale)
        if min_nodes <= len(shape.nodes) <= max_nodes and shape.processes <= max_processes:
            shape.steps = rng.randint(*steps)
            shape.checkpoint_every = rng.randint(2, 5)
            if scale:  # time for replicas to start, take work, die, come back and leave mid-run
                shape.steps, shape.pace_s = max(shape.steps, SCALE_STEPS), SCALE_PACE_S
            draw = rng.random() < 0.5  # drawn last: the graph, steps and checkpoints do not depend on it
            shape.ragged = draw if ragged is None else bool(ragged)
            if shape.ragged:
                for d in shape.nodes.values():
                    if d.cls in RAGGED_CONFIG:
                        d.config["ragged"] = True
            _with_concurrency(shape, concurrency)
            if groups:
                _with_groups(shape)
            _with_fusion(shape, fusion)
            return shape


RAGGED_MARK = ", ragged"
"""What `Shape.describe` adds to its first line for a ragged shape."""
CONCURRENCY_MARK = " ~{}"
"""What `Shape.describe` adds to a node with `concurrency` > 1 (` ~3`: three calls at once)."""
GROUPS_MARK = "{steps} updates x {g} group tickets ({tickets} tickets)"
"""How `Shape.describe`'s first line counts a `ticket: group` shape's work."""


def _with_concurrency(shape: Shape, concurrency: bool | None) -> None:
    """`concurrency: 2..6` on some stateless single-rank nodes (a paced source keeps 1: its pace is
    per ticket). Drawn from a stream of the seed's own, so nothing else about the shape changes."""
    if concurrency is False:
        return
    rng = random.Random(f"concurrency:{shape.seed}")
    eligible = [d for d in shape.nodes.values() if d.cls in CONCURRENT and d.ranks == 1
                and not (d.cls == "TicketSource" and shape.pace_s)]
    if not eligible or (concurrency is None and rng.random() >= 0.5):
        return
    chosen = [d for d in eligible if rng.random() < 0.4] or [rng.choice(eligible)]
    for d in chosen:
        d.concurrency = rng.randint(2, 6)
        d.config["linger_s"] = LINGER_S


FUSABLE = ("Mix", "Drop", "Shrink")
"""Stateless one-in, one-out classes that may run inside their producer's process (`fuse_into`)."""
FUSED_MARK = " in {}"
"""What `Shape.describe` adds to a fused node (` in mix1`: it runs in mix1's process)."""


def _with_fusion(shape: Shape, fusion: bool | None) -> None:
    """`fuse_into: PRODUCER` on some stateless single-process transforms whose producer feeds only
    them, and `fuse_into: CONSUMER` on a source whose one consumer is a stateless transform (which
    then takes the tickets; flowrl.graph.fusion's rules), drawn from a stream of the seed's own:
    the graph, steps, schedule and model stay what they were; only which process runs which call
    changes. Not in shapes made for scale events (the node to scale must keep a process of its own)."""
    if fusion is False or shape.pace_s:
        return
    rng = random.Random(f"fusion:{shape.seed}")
    eligible = [d for d in shape.nodes.values() if d.cls in FUSABLE and d.replicas == 1 and d.ranks == 1
                and d.concurrency == 1 and len(d.inputs) == 1]
    eligible = [d for d in eligible if (p := shape.nodes[next(iter(d.inputs.values()))]).ranks == 1
                and not p.sink and shape.consumers(p.name) == [d.name]]
    sources = [d for d in shape.nodes.values() if d.cls == "TicketSource" and d.replicas == 1 and d.concurrency == 1
               and len(shape.consumers(d.name)) == 1]
    sources = [d for d in sources if (c := shape.nodes[shape.consumers(d.name)[0]]).cls != "Merge" and not c.stateful
               and not c.sink and c.ranks == 1]
    if not (eligible or sources) or (fusion is None and rng.random() >= 0.5):
        return
    for d in [d for d in eligible if rng.random() < 0.5] or ([rng.choice(eligible)] if eligible else []):
        d.fuse_into = next(iter(d.inputs.values()))
    for d in sources:  # the source into its consumer (which then takes the tickets), unless that is fused into it
        consumer = shape.consumers(d.name)[0]
        if shape.nodes[consumer].fuse_into is None and (rng.random() < 0.5 or not eligible):
            d.fuse_into = consumer


def _with_groups(shape: Shape) -> None:
    """Half of the shapes without a `Hold` node (a stream of the seed's own) become
    `schedule.ticket: group`: G = `batch_size` (2-4) one-prompt tickets per update, about as many
    tickets as the shape had steps, a checkpoint every 1-2 updates; every stateful sink is told G
    (`per_update`). Not with `Hold`: the run's end moves with each replaced ticket, and how the
    tickets past the planned end group into updates then depends on when the sink hears of it."""
    rng = random.Random(f"groups:{shape.seed}")
    if any(d.cls == "Hold" for d in shape.nodes.values()) or rng.random() >= 0.5:
        return
    shape.groups = True
    shape.batch_size = rng.choice((2, 3, 4))
    shape.steps = max(3, round(shape.steps / shape.batch_size))
    shape.checkpoint_every = rng.choice((1, 2))
    for d in shape.nodes.values():
        if d.sink and d.stateful:
            d.config["per_update"] = shape.batch_size


def _grow(rng: random.Random, seed: int, min_nodes: int, max_nodes: int, drops: bool, holds: bool = False,
          ranks: bool = False, scale: bool = False) -> Shape:
    nodes: dict[str, NodeDef] = {}
    counter: dict[str, int] = {}

    def name_for(cls: str) -> str:
        short = {"TicketSource": "src", "FoldSink": "sink", "LogSink": "log", "RFoldSink": "rsink",
                 "RTrainer": "trainer"}.get(cls, cls.lower())
        counter[short] = counter.get(short, 0) + 1
        return short if counter[short] == 1 else f"{short}{counter[short]}"

    def add(cls: str, inputs: dict[str, str], **config) -> str:
        name = name_for(cls)
        replicas = 2 if cls in ("Mix", "Drop", "Shrink", "LogSink") and rng.random() < 0.3 else 1
        nodes[name] = NodeDef(name, cls, inputs, config, replicas, rng.choice((2, 2, 3)) if cls in RANKED else 1)
        return name

    open_: list[str] = [add("TicketSource", {}, seed=rng.randrange(1000))]
    n_sinks = rng.choice((1, 1, 2, 2, 3))
    n_inner = rng.randint(max(1, min_nodes - 1 - n_sinks), max(1, max_nodes - 1 - n_sinks))
    kinds = ["Mix", "Mix", "Fold", "Fold", "Shrink"] + (["Drop"] if drops else []) + (["Hold", "Hold"] if holds else [])
    trainer = False
    if ranks:
        kinds += ["RMix", "RMix", "RFold"]
        trainer = rng.random() < 0.5
    for _ in range(n_inner):
        op = rng.random()
        if len(open_) >= 2 and op < 0.5:  # join two open outputs
            a, b = rng.sample(open_, 2)
            open_ = [o for o in open_ if o not in (a, b)]
            open_.append(add("Merge", {"a": a, "b": b}))
            continue
        producers = [n for n, d in nodes.items() if not d.sink]
        src = rng.choice(open_) if op < 0.6 else rng.choice(producers)  # else a fan-out (broadcast)
        if src in open_:
            open_.remove(src)
        cls = rng.choice(kinds)
        config = {"Mix": lambda: {"mul": rng.randrange(2, 97), "add": rng.randrange(100)},
                  "Drop": lambda: {"seed": rng.randrange(1000), "rate": rng.choice((0.1, 0.25, 0.4))},
                  "Shrink": lambda: {"seed": rng.randrange(1000)},
                  "RMix": lambda: {"mul": rng.randrange(2, 97), "add": rng.randrange(100)},
                  "Hold": lambda: {"seed": rng.randrange(1000), "rate": rng.choice((0.2, 0.35))}}.get(cls, dict)()
        open_.append(add(cls, {"in": src}, **config))
    while len(open_) > n_sinks:  # too many open outputs: join two
        a, b = rng.sample(open_, 2)
        open_ = [o for o in open_ if o not in (a, b)]
        open_.append(add("Merge", {"a": a, "b": b}))
    sink_inputs = list(open_)
    producers = [n for n, d in nodes.items() if not d.sink]
    while len(sink_inputs) < n_sinks:  # extra sinks: a fan-out (broadcast) of any node
        sink_inputs.append(rng.choice(producers))
    for i, src in enumerate(sink_inputs):
        cls = "FoldSink" if i == 0 or rng.random() < 0.5 else "LogSink"
        if ranks and i == 0 and trainer:
            cls = "RTrainer"
        elif ranks and cls == "FoldSink" and rng.random() < 0.4:
            cls = "RFoldSink"
        add(cls, {"in": src})
    if ranks:
        _with_ranks(rng, nodes, name_for, trainer)
    if scale and not any(d.scalable for d in nodes.values()):
        _insert(rng, nodes, NodeDef(name_for("Mix"), "Mix", {}, {"mul": rng.randrange(2, 97), "add": rng.randrange(100)}))
    return Shape(seed=seed, nodes=nodes, steps=0, batch_size=rng.choice((2, 4, 8)), checkpoint_every=0,
                 max_staleness=rng.choice((0, 1, 2, 3)))


def _insert(rng: random.Random, nodes: dict[str, NodeDef], new: NodeDef, before: NodeDef | None = None) -> None:
    """Put the one-input node `new` on a random edge (producer -> new -> consumer), or on the input
    edge of the one-input node `before`, keeping `nodes` in topological order."""
    d, port = (before, "in") if before is not None else rng.choice([(d, p) for d in nodes.values() for p in d.inputs])
    new.inputs = {"in": d.inputs[port]}
    d.inputs[port] = new.name
    order = list(nodes.values())
    at = order.index(d)
    nodes.clear()
    nodes.update((x.name, x) for x in [*order[:at], new, *order[at:]])


def _with_ranks(rng: random.Random, nodes: dict[str, NodeDef], name_for, trainer: bool) -> None:
    """At least one data-parallel node; with a trainer, its subscriber on a random edge."""
    if not any(d.ranks > 1 for d in nodes.values()):
        swap = {"Mix": "RMix", "Fold": "RFold", "FoldSink": "RFoldSink"}
        d = rng.choice([d for d in nodes.values() if d.cls in swap])  # the first sink is a FoldSink at worst
        d.cls, d.ranks, d.replicas = swap[d.cls], rng.choice((2, 2, 3)), 1
    if trainer:  # its subscriber: one replica or two, or data parallel (a third of the time)
        t = next(d for d in nodes.values() if d.cls == "RTrainer")
        config = {"mul": rng.randrange(2, 97), "add": rng.randrange(100), "ranks": t.ranks}
        if rng.random() < 1 / 3:
            sub = NodeDef(name_for("RSub"), "RSub", {}, config, ranks=rng.choice((2, 3)))
        else:
            sub = NodeDef(name_for("Sub"), "Sub", {}, config, replicas=2 if rng.random() < 0.3 else 1)
        # half the time the shape of PPO / DAPO: the rollout (subscriber) feeds the trainer, through a
        # filter (replicated: its tickets arrive out of order, several are then released at once)
        _insert(rng, nodes, sub, t if rng.random() < 0.5 else None)
        if rng.random() < 0.5:
            drop = NodeDef(name_for("Drop"), "Drop", {}, {"seed": rng.randrange(1000), "rate": rng.choice((0.25, 0.4))},
                           replicas=rng.choice((1, 2)))
            _insert(rng, nodes, drop, t)
