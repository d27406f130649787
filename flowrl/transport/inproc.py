"""inproc:// endpoints: both ends in one process (tests, and nodes colocated in one process).

They share the process-wide ZeroMQ context. ZeroMQ reports no connection events for inproc, so
channels fall back to heartbeat deadlines (`peer_timeout_s`) to notice a vanished peer.
"""

from __future__ import annotations

import uuid

from flowrl.transport.endpoints import Endpoint, safe_name


class InprocEndpoint(Endpoint):
    scheme = "inproc"

    def choose(self) -> str:
        return f"inproc://flowrl-{safe_name(self.name)}-{uuid.uuid4().hex[:8]}"
