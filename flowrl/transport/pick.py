"""Which endpoint class serves an address (by its scheme) or a transport kind."""

from __future__ import annotations

from flowrl.transport.config import ChannelConfig
from flowrl.transport.endpoints import SCHEMES, Endpoint, scheme_of
from flowrl.transport.inproc import InprocEndpoint
from flowrl.transport.ipc import IpcEndpoint
from flowrl.transport.tcp import TcpEndpoint


def endpoint_for(address_or_kind: str, config: ChannelConfig, name: str) -> Endpoint:
    """The endpoint class for an address (by its scheme) or for a transport kind."""
    kind = address_or_kind if address_or_kind in SCHEMES else scheme_of(address_or_kind)
    cls = {"ipc": IpcEndpoint, "tcp": TcpEndpoint, "inproc": InprocEndpoint}[kind]
    return cls(config, name)
