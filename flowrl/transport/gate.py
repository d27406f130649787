"""Who may talk to a consumer: the proof of the channel's secret in hellos, and how often links the
consumer does not know get an answer. One `Gate` per `Receiver`; single-threaded (the event loop).

With a secret, a producer link's first hello carries no proof; the consumer answers `known: false`
with a nonce derived from its own random key and the link's routing id (`security.nonce_for`: no
state is kept for links not known yet), and the link proves the secret on that nonce in every hello
after (`security.proof`). Answers to unknown links (that nonce, or "start a new link") go out at most
once per link per heartbeat and REPLY_RATE per second in all, so a flood of strangers costs bounded
CPU and bytes.
"""

from __future__ import annotations

import secrets
import time

from flowrl.transport import security, wire
from flowrl.transport.errors import DecodeError

REPLY_RATE = 1000.0  # answers to unknown links per second, at most (in bursts of REPLY_BURST)
REPLY_BURST = 200
REPLY_MEMORY = 4096  # unknown links whose last answer time is remembered (one answer per heartbeat each)


class Gate:
    """Admission of producer links to one consumer; see the module docstring."""

    def __init__(self, secret: bytes | None, heartbeat_s: float):
        self.secret, self.heartbeat_s = secret, heartbeat_s
        self._key = secrets.token_bytes(32)
        self._answered: dict[bytes, float] = {}  # unknown link -> when it was last answered
        self._tokens, self._t = float(REPLY_BURST), time.monotonic()
        self.challenged = self.dropped = 0

    def nonce(self, rid: bytes) -> bytes | None:
        """The nonce link `rid` proves the secret on (None: the channel has no secret)."""
        return None if self.secret is None else security.nonce_for(self._key, rid)

    def admit(self, rid: bytes, hello: wire.Hello, known_proof: bytes | None, known: bool) -> bool:
        """Whether `hello` from link `rid` may be acted on. False: it is an unknown link's first hello,
        to be answered with its nonce. Raises DecodeError for a missing or wrong proof. `known_proof`:
        the proof the link gave when it became known (`known`)."""
        if self.secret is None:
            return True
        expected = known_proof if known else security.proof(self.secret, self.nonce(rid), rid)
        if security.proof_ok(expected, hello.mac):
            return True
        if not known and hello.mac is None and rid not in self._answered:
            self.challenged += 1  # a link's first hello: the nonce is the answer, not an error
            return False
        if hello.mac is None:
            raise DecodeError("no_proof", f"a hello from link {rid[:24]!r} without proof of the secret")
        raise DecodeError("bad_proof", f"a hello from link {rid[:24]!r} with a wrong proof of the secret")

    def may_answer(self, rid: bytes) -> bool:
        """Whether an unknown link may be answered now (rate limits in the module docstring)."""
        now = time.monotonic()
        self._tokens = min(REPLY_BURST, self._tokens + (now - self._t) * REPLY_RATE)
        self._t = now
        last = self._answered.get(rid)
        if self._tokens < 1 or (last is not None and now - last < self.heartbeat_s):
            self.dropped += 1
            return False
        self._tokens -= 1
        if len(self._answered) >= REPLY_MEMORY:
            self._answered.clear()
        self._answered[rid] = now
        return True
