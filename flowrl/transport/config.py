"""Typed channel configuration; unknown keys are rejected, every field says what it bounds.

    cfg = ChannelConfig(transport="ipc", capacity_messages=4, capacity_bytes=256 << 20)
    cfg = ChannelConfig(transport="tcp", allow_remote=True, curve=CurveConfig(...))   # across hosts

Both ends of a channel should use the same config; the consumer's capacities are the ones that
count (it grants the credit).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretBytes, SecretStr, field_validator, model_validator

from flowrl.transport.wire import DecodeLimits

Z85_KEY_CHARS = 40
MIN_SECRET_BYTES = 16
CREDIT_IDLE_MIN_S = 10.0


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class CurveConfig(_Model):
    """CURVE keys (Z85 text, 40 chars) for an encrypted, authenticated tcp link between hosts.

    Make a key pair with `zmq.curve_keypair()` (`CurveConfig.keypair()` returns it as text). The
    consumer sets `server_public` + `server_secret`; each producer sets `server_public` (to know whom
    it talks to) and its own client pair (or none: a fresh pair is made per connection).
    """

    server_public: str
    """The consumer's public key; every producer must know it."""
    server_secret: SecretStr | None = None
    """The consumer's secret key (consumer side only)."""
    client_public: str | None = None
    """This producer's public key (producer side; default: an ephemeral pair)."""
    client_secret: SecretStr | None = None
    """This producer's secret key (producer side)."""
    authorized_clients: tuple[str, ...] | None = None
    """Consumer side: only producers holding one of these public keys may connect. None: any
    producer that knows `server_public` may connect (encrypted, server authenticated)."""

    @field_validator("server_public", "client_public")
    @classmethod
    def _z85(cls, v):
        if v is not None and len(v) != Z85_KEY_CHARS:
            raise ValueError(f"CURVE keys are {Z85_KEY_CHARS} Z85 chars, got {len(v)}; make one with "
                             "zmq.curve_keypair()")
        return v

    @model_validator(mode="after")
    def _pairs(self):
        if (self.client_public is None) != (self.client_secret is None):
            raise ValueError("give both client_public and client_secret, or neither (ephemeral pair)")
        for key in self.authorized_clients or ():
            if len(key) != Z85_KEY_CHARS:
                raise ValueError(f"authorized client key {key[:8]}... is not {Z85_KEY_CHARS} Z85 chars")
        return self

    @staticmethod
    def keypair() -> tuple[str, str]:
        """A fresh (public, secret) pair as Z85 text."""
        import zmq

        public, secret = zmq.curve_keypair()
        return public.decode(), secret.decode()


class ChannelConfig(_Model):
    """How one channel (one graph edge) behaves. Defaults are safe on one host."""

    transport: Literal["ipc", "tcp", "inproc"] = "ipc"
    """Address kind when `bind()` chooses the address: ipc (a socket file in a private directory),
    tcp (loopback, a free port) or inproc (same process only; for tests)."""
    capacity_messages: int = Field(16, ge=1)
    """Messages a consumer holds at most (received, not yet acknowledged) plus credit it has
    granted; a producer waits beyond that. Bounds memory and pipelining depth."""
    capacity_bytes: int = Field(256 << 20, ge=1)
    """Bytes a consumer holds at most plus credit it has granted. A single message larger than this
    is refused by `send()` with a clear error."""
    max_message_bytes: int = Field(1 << 30, ge=1)
    """Largest message (all frames) a consumer decodes; larger ones are rejected."""
    heartbeat_s: float = Field(0.5, gt=0)
    """Interval of link heartbeats (credit refresh, liveness probes)."""
    peer_timeout_s: float = Field(5.0, gt=0)
    """How long a peer may stay unreachable: after it a producer hands unacknowledged batches back
    (and `send()` raises BrokenChannel) and a consumer whose producers all died raises
    BrokenChannel. Also the idle timeout of the ZeroMQ-level heartbeat on each connection."""
    inline_max_bytes: int = Field(8192, ge=0)
    """Tensors up to this size travel inside the header frame instead of in a frame of their own."""
    max_header_bytes: int = Field(1 << 20, ge=64)
    """Largest header frame (metadata and inline tensors) a consumer decodes."""
    max_frames: int = Field(1024, ge=2)
    """Most frames in one message a consumer decodes."""
    max_meta_depth: int = Field(32, ge=1)
    """Deepest nesting of `meta` a consumer decodes."""
    shm_bytes: int = Field(1 << 30, ge=0)
    """Shared memory a producer may lend one consumer of an ipc channel (both on one host) for large
    messages: their tensors are copied once into it and the consumer maps them, instead of both
    sides copying them through a socket. Blocks are reserved, not filled: memory is used only as far
    as it is written. A consumer maps at most this much per producer link. 0 turns it off."""
    shm_min_bytes: int = Field(1 << 16, ge=1)
    """Messages whose tensors outside the header add up to at least this many bytes go through
    shared memory when the link has it; smaller ones are cheaper on the socket."""
    shm_window_bytes: int = Field(64 << 20, ge=1)
    """Shared memory a producer may have lent to one consumer at once (but always two blocks, however
    large). A new block costs a page fault per page on its first write, so the window stays small
    and blocks are reused; with its window lent, a producer waits briefly for a block to come back
    (and sends over the socket if none does)."""
    ipc_dir: str | None = None
    """Parent folder of the private (0700) folders that hold ipc socket files; default: the system
    temp folder."""
    allow_remote: bool = False
    """Allow tcp addresses that are not loopback (binding 0.0.0.0, connecting to other hosts). Use
    with `curve` so the link is encrypted and authenticated."""
    curve: CurveConfig | None = None
    """CURVE keys; None: no encryption (fine on loopback and ipc)."""
    secret: SecretBytes | None = None
    """Per-run secret (at least 16 bytes; the runtime makes a random one per run) that every producer
    link proves it knows before a consumer grants it anything: the consumer hands each link a nonce,
    the link answers with HMAC-SHA256(secret, nonce) in every hello; the secret itself never travels.
    Keeps stray local processes out of a channel; across hosts add `curve` (encryption). None: any
    process that can reach the socket may join (ipc sockets are still 0600 in a 0700 folder)."""
    link_capacity_messages: int | None = Field(None, ge=1)
    """Most messages one producer link may hold (granted credit + unacknowledged). None: all of
    `capacity_messages`. Set it below the capacity where several producers feed one consumer, so
    that one link (a buggy or hostile one) can never hold all of the consumer's credit."""
    link_capacity_bytes: int | None = Field(None, ge=1)
    """Most bytes one producer link may hold, and so the largest message it may send (a `need` above
    it is refused). None: all of `capacity_bytes`. See `link_capacity_messages`."""
    credit_idle_s: float | None = Field(None, gt=0)
    """A link that holds granted credit and sends nothing for this long, while another link waits for
    credit, loses its link (its producer, if alive, starts a new one and re-sends what was not
    acknowledged), so its credit goes to the one that waits. Nobody waiting: nothing is taken (a
    producer busy computing between batches keeps its link). None: 2 x `peer_timeout_s`, and at
    least 10 s (see `credit_idle`)."""

    @model_validator(mode="after")
    def _timeouts(self):
        if self.peer_timeout_s < 2 * self.heartbeat_s:
            raise ValueError(f"peer_timeout_s={self.peer_timeout_s} must be at least 2 x heartbeat_s="
                             f"{self.heartbeat_s}; raise peer_timeout_s or lower heartbeat_s")
        if self.credit_idle_s is not None and self.credit_idle_s < 2 * self.heartbeat_s:
            raise ValueError(f"credit_idle_s={self.credit_idle_s} must be at least 2 x heartbeat_s="
                             f"{self.heartbeat_s} (idle producers hand credit back once per heartbeat)")
        if self.secret is not None and len(self.secret.get_secret_value()) < MIN_SECRET_BYTES:
            raise ValueError(f"secret has {len(self.secret.get_secret_value())} bytes; use at least "
                             f"{MIN_SECRET_BYTES} random bytes (secrets.token_bytes(32))")
        return self

    def link_caps(self) -> tuple[int, int]:
        """(messages, bytes) one producer link may hold at most (see `link_capacity_*`)."""
        m = min(self.link_capacity_messages or self.capacity_messages, self.capacity_messages)
        return m, min(self.link_capacity_bytes or self.capacity_bytes, self.capacity_bytes)

    def credit_idle(self) -> float:
        """Seconds a link may sit on granted credit without sending (see `credit_idle_s`)."""
        return self.credit_idle_s or max(2 * self.peer_timeout_s, CREDIT_IDLE_MIN_S)

    def max_frame_bytes(self) -> int:
        """The largest frame a consumer's socket takes (ZeroMQ's MAXMSGSIZE): no message may exceed
        what one link is ever granted, so a bigger frame is cut off by its length prefix, unread."""
        return min(self.max_message_bytes, self.link_caps()[1])

    def limits(self) -> DecodeLimits:
        return DecodeLimits(max_header_bytes=self.max_header_bytes, max_frames=self.max_frames,
                            max_message_bytes=self.max_message_bytes, max_depth=self.max_meta_depth)
