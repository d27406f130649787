"""The node-shape rule, once: sources, sinks, observers, joins and stateful nodes of a graph."""

import flowrl
from flowrl.graph.shapes import is_join, is_sink, node_shapes
from flowrl.node import Join, Observer, Sink, Source


class Make(Source):
    outputs = ("out",)


class Step(flowrl.Node):
    pass


class Learn(Sink):
    stateful = True


class Watch(Observer):
    pass


class Merge(Join):
    outputs = ()


def test_each_node_gets_its_shape_from_its_ports_and_base_class():
    shapes = node_shapes({"make": Make, "step": Step, "learn": Learn, "watch": Watch, "merge": Merge})
    assert shapes == {"sources": ["make"], "sinks": ["learn", "merge"], "observers": ["watch"], "stateful": ["learn"]}
    assert is_join(Merge) and not is_join(Step)
    assert not is_sink(Watch)  # no outputs, but nothing reaches it: an observer ends no ticket


def test_the_controller_still_exports_node_shapes():
    from flowrl.runtime.controller.controller import node_shapes as exported

    assert exported is node_shapes
