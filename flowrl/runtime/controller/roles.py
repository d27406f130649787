"""What each node of the graph is to the controller: source, sink, stateful, publisher, subscriber.

A frozen value, worked out once from the graph and its node classes and handed to the components
that need it (the ticket desk sends to sources, the weight-sync group forms of publishers and
subscribers, recovery rolls stateful nodes back and tells sinks what they consumed).
"""

from __future__ import annotations

from dataclasses import dataclass


def node_shapes(classes: dict) -> dict[str, list[str]]:
    """Which nodes are sources, sinks, observers and stateful."""
    from flowrl.node import Source

    observers = [n for n, c in classes.items() if not issubclass(c, Source) and not c.inputs and not c.outputs]
    return {"sources": [n for n, c in classes.items() if issubclass(c, Source)],
            "sinks": [n for n, c in classes.items() if not c.outputs and n not in observers],
            "observers": observers,
            "stateful": [n for n, c in classes.items() if c.stateful]}


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
