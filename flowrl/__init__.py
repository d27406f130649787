"""flowrl: RL post-training of language models as a dataflow of OS processes.

The public API is small: the Node base classes and their config/ticket types, the Batch that
travels between nodes (with Ragged tensors: one sequence of its own length per sample), graph loading, `run`, and the error types. Built-in nodes use nothing else.
"""

__version__ = "0.1.0"

from flowrl.graph import GraphError, GraphSpec, load_graph
from flowrl.errors import FlowrlError
from flowrl.node import Drop, Join, Node, NodeConfig, NodeContext, Observer, Sink, Source, Ticket

__all__ = [
    "Batch", "Drop", "FlowrlError", "GraphError", "GraphSpec", "Join", "Node", "NodeConfig", "NodeContext",
    "Observer", "Ragged", "Sink", "Source", "Ticket", "load_graph", "run", "scale",
]


def __getattr__(name: str):
    # Batch comes with the transport (zmq, msgpack); `run` with the runtime. Both load on first
    # use, so `import flowrl` (and `flowrl check`) stays light.
    if name == "Batch":
        from flowrl.transport import Batch

        return Batch
    if name == "Ragged":
        from flowrl.transport.ragged import Ragged

        return Ragged
    if name in ("run", "scale"):
        from flowrl.runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")
