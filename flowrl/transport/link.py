"""Producer-side state of one link (one socket to one consumer replica) and of one sent message.

A link lives from a connect until its consumer is lost; then the sender closes it and opens a new
one (new socket, new routing id `<sender id>.<epoch>`) to the same address, so that nothing of the
old session — queued frames, credit counters, sequence bookkeeping — can leak into the new one.
"""

from __future__ import annotations

import time
from typing import Any

from flowrl.transport.codec import Prepared

ENV_ALLOWANCE = 64  # bytes the channel envelope can add to a header


class Entry:
    """One batch on its way: held from its first send until acknowledged or handed back. Its
    prepared form (header and buffers) is kept only until it is written: a batch in flight holds
    the batch alone, and a re-send prepares it again (`Sender._pick`). Held, the header's lists and
    inline bytes stayed alive for every batch in flight, and the cyclic garbage collector walked
    them at each of its young-generation passes (at 4 KiB, a few hundred batches in flight)."""

    __slots__ = ("seq", "batch", "prepared", "size")

    def __init__(self, seq: int, prepared: Prepared):
        self.seq, self.batch, self.size = seq, prepared.batch, 0  # size: bytes of the last framing
        self.prepared: Prepared | None = prepared  # None once written


class Link:
    """Credit, acknowledgement and liveness state towards one consumer incarnation."""

    def __init__(self, address: str, epoch: int, rid: bytes):
        self.address, self.epoch, self.rid = address, epoch, rid
        self.pump: Any = None          # sockets.Pump of the DEALER socket
        self.mon: Any = None           # sockets.Pump of its connection monitor (ipc/tcp)
        self.inc: str | None = None    # consumer incarnation, from its first status
        self.proof: bytes | None = None  # proof of the channel secret for this link (from the consumer's nonce)
        self.refused: str | None = None  # why the consumer would not let this link in (the secret), if known
        self.dead = False
        self.live = False              # answered (inc known) and not given up on
        self.last_heard = time.monotonic()
        self.cap_m = self.cap_b = self.max_msg = 0
        self.lim_m = self.lim_b = 0    # cumulative limits granted by the consumer
        self.sent_m = self.sent_b = 0  # cumulative, on this link
        self.ret_m = self.ret_b = 0    # cumulative credit handed back
        self.unacked: dict[int, Entry] = {}
        self.eos_acked = False
        self.used = False              # sent something since the last heartbeat
        self.picked = 0                # when the sender last chose it (ties between replicas go round-robin)
        self.idle = False
        self.need = 0                  # bytes of the message we wait to send (0: not waiting)
        self.arena: Any = None         # shm.ShmArena lent to this consumer (ipc links), or None
        self.shm_ok = False            # the consumer mapped our probe: large messages may use the arena
        self.shm_wait: float | None = None  # since when a message waits for a block to come back
        self.shm_starved = False       # none came back in time: the socket until one does

    @property
    def avail_m(self) -> int:
        return self.lim_m - self.sent_m - self.ret_m

    @property
    def avail_b(self) -> int:
        return self.lim_b - self.sent_b - self.ret_b

    def release_unused(self) -> None:
        """Hand back every credit held unused (cumulative `ret_m`, `ret_b`; the next hello says so)."""
        self.ret_m += max(0, self.avail_m)
        self.ret_b += max(0, self.avail_b)

    def give_back_credit(self) -> None:
        if self.avail_m > 0 or self.avail_b > 0:
            self.release_unused()
            self.idle = True
