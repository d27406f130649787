"""Moved to `flowrl.node` (the Node API lives at the package root); kept so old imports work."""

from flowrl.node import Drop, Join, Node, NodeConfig, NodeContext, Observer, Sink, Source, Ticket

__all__ = ["Drop", "Join", "Node", "NodeConfig", "NodeContext", "Observer", "Sink", "Source", "Ticket"]
