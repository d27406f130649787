"""The ways a channel operation can fail or end, each with its own name (trio `_core/_exceptions.py`).

    TransportError           base of everything below
    ├── DecodeError          bytes that are not a valid message (or exceed a limit); the message is
    │                        dropped and counted, the channel keeps working
    ├── ChannelClosed        closed by us: `aclose()` was called, or `send()` after `end_of_stream()`
    ├── BrokenChannel        broken by the peer; `cause` says which peer and what happened
    └── EndOfStream          every producer finished its stream; not an error
"""

from __future__ import annotations


class TransportError(Exception):
    """Base class of every error raised by `flowrl.transport`."""


class DecodeError(TransportError):
    """A message violates the wire schema or a decoding limit.

    `reason` is a short stable code (`header_too_large`, `dtype`, `size_mismatch`, ...) that receivers
    use as the key of their `rejected_by_reason` statistics.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class ChannelClosed(TransportError):
    """The channel was closed on this side; nothing more can be sent or received through it."""


class BrokenChannel(TransportError):
    """The peer side is gone and did not come back in time.

    Not terminal: a `Receiver` whose producers all died raises it from `recv()` until a producer
    connects again; a `Sender` whose consumers all died raises it from `send()` until one answers.
    """

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


class AddressInUse(TransportError):
    """Another live socket serves the address (a consumer restarted too early retries for a while)."""


class EndOfStream(TransportError):
    """Every producer that connected to the channel sent end-of-stream and all data was received."""
