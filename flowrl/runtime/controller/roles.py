"""What each node of the graph is to the controller: source, sink, stateful, publisher, subscriber.

A frozen value, worked out once from the graph and its node classes and handed to the components
that need it (the ticket desk sends to sources, the weight-sync group forms of publishers and
subscribers, recovery rolls stateful nodes back and tells sinks what they consumed).
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.graph.shapes import node_shapes  # the rule, once, below the runtime


@dataclass(frozen=True)
class Roles:
    sources: tuple[str, ...] = ()
    sinks: tuple[str, ...] = ()
    stateful: tuple[str, ...] = ()
    publishers: tuple[str, ...] = ()  # weight edges' sources (trainers)
    subscribers: tuple[str, ...] = ()  # weight edges' destinations

    @classmethod
    def of(cls, spec, classes: dict) -> "Roles":
        shapes = node_shapes(classes)
        return cls(sources=tuple(shapes["sources"]), sinks=tuple(shapes["sinks"]), stateful=tuple(shapes["stateful"]),
                   publishers=tuple(w.src for w in spec.weights), subscribers=tuple(w.dst for w in spec.weights))

    @property
    def stateful_sinks(self) -> list[str]:
        return [s for s in self.sinks if s in self.stateful]
