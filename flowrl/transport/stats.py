"""`ChannelStats`: a snapshot of one end of a channel, for metrics and for tests.

Counters are totals since the channel was created (reduce them with `sum` across processes);
gauges (`in_flight`, `queued*`, `credit_*`, `peers`) are the current values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ChannelStats:
    """One end of a channel. Fields that do not apply to the role stay 0."""

    name: str
    role: str
    """`sender` or `receiver`."""
    peers: int = 0
    """Live links: consumer replicas (sender) or producer links (receiver)."""
    in_flight: int = 0
    """Sender: sent and not yet acknowledged, plus waiting to be re-sent. Receiver: received and
    not yet acknowledged (queued or being processed)."""
    in_flight_bytes: int = 0
    queued: int = 0
    """Receiver: received, not yet returned by `recv()`. Sender: waiting to be re-sent."""
    queued_bytes: int = 0
    """Receiver: bytes held (received, not acknowledged) - what flow control bounds."""
    credit_messages: int = 0
    """Sender: credit available on live links. Receiver: capacity not granted to anyone."""
    credit_bytes: int = 0
    sent: int = 0
    sent_bytes: int = 0
    received: int = 0
    received_bytes: int = 0
    acked: int = 0
    resent: int = 0
    """Sender: messages sent again after their consumer was lost."""
    returned: int = 0
    """Sender: batches handed back to the caller (no consumer could take them in time)."""
    rejected: int = 0
    """Receiver: messages dropped as malformed, over a limit, or against the protocol."""
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    peers_lost: int = 0
    """Links given up on: consumer restarted or gone (sender), producer died (receiver)."""
    credit_waits: int = 0
    """Sender: `send()` calls that had to wait for credit (back-pressure)."""
    credit_wait_s: float = 0.0
    """Sender: total seconds `send()` waited for credit."""
    shm: int = 0
    """Messages whose tensors went through shared memory (sent, or received), not the socket."""
    shm_bytes: int = 0
    challenged: int = 0
    """Receiver: hellos without proof of the secret from links not known yet, answered with a nonce
    (every producer link's first hello when the channel has a secret)."""
    reclaimed: int = 0
    """Receiver: links ended because they sat on granted credit for `credit_idle_s` without sending."""
    replies_dropped: int = 0
    """Receiver: answers to unknown links not sent (rate limit: one per link per heartbeat, 1000/s in all)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
