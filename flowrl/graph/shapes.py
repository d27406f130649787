"""Node shapes: what a node class is in the data flow, decided once for the graph checks, the
controller and the worker.

    source     a `Source`: turns tickets into batches (`generate`)
    observer   not a source, no inputs and no outputs: watches the policy (`observe`)
    sink       no outputs and not an observer: where a ticket ends (it reports consumption)
    join       more than one input: gathers one batch per input (`join`)
    stateful   `cls.stateful`: checkpointed, takes tickets in index order

    node_shapes({"prompts": Prompts, "actor": Actor, "eval": Evaluator})
    # -> {"sources": ["prompts"], "sinks": ["actor"], "observers": ["eval"], "stateful": ["actor"]}
"""

from __future__ import annotations


def is_source(cls: type) -> bool:
    from flowrl.node import Source

    return issubclass(cls, Source)


def is_observer(cls: type) -> bool:
    return not cls.inputs and not cls.outputs and not is_source(cls)


def is_sink(cls: type) -> bool:
    return not cls.outputs and not is_observer(cls)


def is_join(cls: type) -> bool:
    """The runtime's rule (the worker gathers and calls `join`). `flowrl check` asks a `Join`
    subclass for an async `join` instead (graph/structure.py): the same for every node that
    subclasses `Join` and keeps its two or more inputs."""
    return len(cls.inputs) > 1


def node_shapes(classes: dict[str, type]) -> dict[str, list[str]]:
    """Node names by shape: sources, sinks, observers, stateful (in the order of `classes`)."""
    return {"sources": [n for n, c in classes.items() if is_source(c)],
            "sinks": [n for n, c in classes.items() if is_sink(c)],
            "observers": [n for n, c in classes.items() if is_observer(c)],
            "stateful": [n for n, c in classes.items() if c.stateful]}
