"""Moved to `flowrl.node` (the Node API lives at the package root); kept so old imports work."""

from flowrl.node import *  # noqa: F401,F403
from flowrl.node import Drop, Join, Node, NodeConfig, NodeContext, Observer, Sink, Source, Ticket  # noqa: F401
