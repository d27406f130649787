"""The shape of a node (source, transform, join, sink, observer; stateful; publisher or subscriber
of weights): the facts of its class that decide its input policies and what follows each ticket."""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.graph.shapes import is_join, is_observer, is_sink, is_source  # the rule, once


@dataclass(frozen=True)
class Shape:
    """What a node's class declares, read once at start-up (flowrl/node.py defines each flag)."""

    source: bool
    observer: bool  # no inputs and no outputs: it is shown each weight version (`observe`)
    sink: bool
    join: bool  # more than one input port
    stateful: bool
    publishes: bool  # a trainer: publishes weight versions
    subscribes: bool  # a rollout: takes the versions a trainer publishes
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    requires: dict | None = None  # the tensors (and dtypes) every input batch must carry

    @classmethod
    def of(cls, node_cls) -> "Shape":
        return cls(source=is_source(node_cls), observer=is_observer(node_cls), sink=is_sink(node_cls),
                   join=is_join(node_cls), stateful=node_cls.stateful,
                   publishes=node_cls.publishes_weights, subscribes=node_cls.subscribes_weights,
                   inputs=tuple(node_cls.inputs), outputs=tuple(node_cls.outputs), requires=node_cls.requires)
