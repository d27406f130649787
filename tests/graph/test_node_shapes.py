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


def test_edge_credit_covers_the_tickets_in_flight_and_the_consumers_concurrency():
    from flowrl.graph import GraphSpec

    def credit(schedule, concurrency=1, capacity=4):
        g = GraphSpec(nodes={"a": {"kind": "x:A"}, "b": {"kind": "x:B", "concurrency": concurrency}},
                      edges=[{"from": "a", "to": "b", "capacity": capacity}], schedule=schedule)
        return g.edge_capacity(g.edges[0])

    assert credit({"batch_size": 8}) == 4  # one batch ticket in flight: the edge's own
    assert credit({"batch_size": 8, "ticket": "group"}) == 16  # 8 groups in flight, two links' worth
    assert credit({"batch_size": 16, "ticket": "group", "max_staleness": 1}) == 64
    assert credit({"batch_size": 8}, concurrency=12) == 24 and credit({"batch_size": 8}, capacity=100) == 100
