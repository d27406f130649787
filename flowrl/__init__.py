"""flowrl: RL post-training of language models as a dataflow of OS processes.

The public API is small: the Node base classes and their config/ticket types, the Batch that
travels between nodes, graph loading, `run`, and the error types. Built-in nodes use nothing else.
"""

__version__ = "0.1.0"

from flowrl.graph import GraphError, GraphSpec, load_graph
from flowrl.graph.errors import FlowrlError
from flowrl.runtime.node import Join, Node, NodeConfig, NodeContext, Sink, Source, Ticket

__all__ = [
    "FlowrlError", "GraphError", "GraphSpec", "Join", "Node", "NodeConfig", "NodeContext",
    "Sink", "Source", "Ticket", "load_graph",
]
