"""Random graph shapes of synthetic nodes, seeded: chains, fan-out, joins, 1-3 sinks, stateful
transforms, drops, shrinking filters and replicas of stateless nodes.

    shape = random_shape(seed=7)
    print(shape.describe())        # src -> mix(x2) -> fold* -> {sink*, log}
    spec = shape.graph(features)   # a flowrl.GraphSpec (short heartbeats and timeouts)

A shape grows from its source: each new node consumes one open output (a chain link), an output
that already has a consumer (a fan-out: two edges from one port broadcast), or two outputs (a join);
then every open output gets a sink, and extra sinks hang off random nodes. Every input port has
exactly one edge, so the graph is a DAG whose every path ends in a sink.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from flowrl.testing.chaos.features import Features
from flowrl.testing.chaos.nodes import KINDS

STATELESS = ("Mix", "Drop", "Shrink", "LogSink", "TicketSource")


@dataclass
class NodeDef:
    name: str
    cls: str
    inputs: dict[str, str] = field(default_factory=dict)
    """Input port -> producer node."""
    config: dict = field(default_factory=dict)
    replicas: int = 1

    @property
    def stateful(self) -> bool:
        return self.cls in ("Fold", "FoldSink", "Hold")

    @property
    def sink(self) -> bool:
        return self.cls in ("FoldSink", "LogSink")


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

    @property
    def sinks(self) -> list[str]:
        return [n for n, d in self.nodes.items() if d.sink]

    @property
    def stateful(self) -> list[str]:
        return [n for n, d in self.nodes.items() if d.stateful]

    def consumers(self, name: str) -> list[str]:
        return [d.name for d in self.nodes.values() if name in d.inputs.values()]

    @property
    def processes(self) -> int:
        return sum(d.replicas for d in self.nodes.values())

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
                  f"{self.checkpoint_every}, max_staleness {self.max_staleness}")]
        for d in self.nodes.values():
            rep = f" x{d.replicas}" if d.replicas > 1 else ""
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
        nodes = {d.name: {"kind": KINDS[d.cls], "replicas": d.replicas, "config": dict(d.config),
                          "on_failure": {"policy": "restart", "max_restarts": t.max_restarts, "backoff_s": t.backoff_s}}
                 for d in self.nodes.values()}
        return GraphSpec.model_validate({"name": f"shape{self.seed}", "seed": self.seed, "nodes": nodes,
                                         "edges": self.edges(), "schedule": schedule, "supervision": supervision})


def random_shape(seed: int, *, min_nodes: int = 3, max_nodes: int = 8, max_processes: int = 10,
                 steps: tuple[int, int] = (10, 30), drops: bool = True, holds: bool = False) -> Shape:
    """A random shape (the same for the same seed). `drops=False` leaves out `Drop` filters;
    `holds=True` adds `Hold` nodes (tickets dropped with replace=True, like a DAPO filter's)."""
    rng = random.Random(seed)
    while True:
        shape = _grow(rng, seed, min_nodes, max_nodes, drops, holds)
        if min_nodes <= len(shape.nodes) <= max_nodes and shape.processes <= max_processes:
            shape.steps = rng.randint(*steps)
            shape.checkpoint_every = rng.randint(2, 5)
            return shape


def _grow(rng: random.Random, seed: int, min_nodes: int, max_nodes: int, drops: bool, holds: bool = False) -> Shape:
    nodes: dict[str, NodeDef] = {}
    counter: dict[str, int] = {}

    def add(cls: str, inputs: dict[str, str], **config) -> str:
        short = {"TicketSource": "src", "FoldSink": "sink", "LogSink": "log"}.get(cls, cls.lower())
        counter[short] = counter.get(short, 0) + 1
        name = short if counter[short] == 1 else f"{short}{counter[short]}"
        replicas = 2 if cls in ("Mix", "Drop", "Shrink", "LogSink") and rng.random() < 0.3 else 1
        nodes[name] = NodeDef(name, cls, inputs, config, replicas)
        return name

    open_: list[str] = [add("TicketSource", {}, seed=rng.randrange(1000))]
    n_sinks = rng.choice((1, 1, 2, 2, 3))
    n_inner = rng.randint(max(1, min_nodes - 1 - n_sinks), max(1, max_nodes - 1 - n_sinks))
    kinds = ["Mix", "Mix", "Fold", "Fold", "Shrink"] + (["Drop"] if drops else []) + (["Hold", "Hold"] if holds else [])
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
        add("FoldSink" if i == 0 or rng.random() < 0.5 else "LogSink", {"in": src})
    return Shape(seed=seed, nodes=nodes, steps=0, batch_size=rng.choice((2, 4, 8)), checkpoint_every=0,
                 max_staleness=rng.choice((0, 1, 2, 3)))
