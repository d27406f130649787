"""Credit-based flow control, consumer side: one pool of capacity shared by all producer links.

Invariant (checked by the tests after every step)::

    sum over links (granted-but-unused credit + received-but-unacknowledged) + orphans
        <= capacity            (in messages and in bytes)

so a consumer never holds, nor lets be in flight towards it, more than its capacity — however many
producers connect and however fast they are. Orphans are messages of links that are gone but that
the consumer's code still holds; they count until acknowledged.

Grants, in this order, after every change:
1. a producer blocked on a message (`need` bytes) gets exactly enough for it, first come first
   served; while one cannot be served, nobody else gets credit (no starvation of large messages);
2. every active producer is topped up to an equal share of the capacity (pipelining).
Idle producers hand their unused credit back (and get none eagerly) so they hoard nothing; so does
a producer found blocked at its heartbeat tick with nothing sent since the last (`Sender._tick`),
which then gets all it lacks at once: no link holds credit for long while it waits for more (two
links each holding what the other waited for, bytes without a message and a message without
bytes, waited for good).

No link ever holds more than its cap (`link_m`, `link_b`: granted-unused + unacknowledged): a
`need` above it is refused by the receiver before it gets here, and a need that only its own
unacknowledged messages keep from fitting waits for them without holding up anyone else.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable


@dataclass(slots=True)
class Account:
    """Credit state of one producer link. `lim`, `recv`, `ret` are cumulative, as on the wire."""

    lim_m: int = 0
    lim_b: int = 0
    recv_m: int = 0
    recv_b: int = 0
    ret_m: int = 0
    ret_b: int = 0
    held_m: int = 0
    held_b: int = 0
    need: int = 0
    need_order: int = 0
    idle: bool = False
    open: bool = True

    @property
    def unused_m(self) -> int:
        return self.lim_m - self.recv_m - self.ret_m

    @property
    def unused_b(self) -> int:
        return self.lim_b - self.recv_b - self.ret_b


class CreditPool:
    """Capacity shared by the producer links of one consumer."""

    def __init__(self, capacity_messages: int, capacity_bytes: int, link_messages: int | None = None,
                 link_bytes: int | None = None):
        self.cap_m, self.cap_b = capacity_messages, capacity_bytes
        self.link_m = min(link_messages or capacity_messages, capacity_messages)
        self.link_b = min(link_bytes or capacity_bytes, capacity_bytes)
        self.accounts: dict[Hashable, Account] = {}
        self.used_m = self.used_b = 0  # granted-unused + held + orphans
        self.orphan_m = self.orphan_b = 0
        self._order = itertools.count()
        self._rr = 0

    @property
    def free_m(self) -> int:
        return self.cap_m - self.used_m

    @property
    def free_b(self) -> int:
        return self.cap_b - self.used_b

    def add(self, key: Hashable) -> Account:
        return self.accounts.setdefault(key, Account())

    def remove(self, key: Hashable) -> None:
        """The link is gone: its unused credit returns, what it delivered stays held as orphans."""
        a = self.accounts.pop(key)
        self.used_m -= a.unused_m
        self.used_b -= a.unused_b
        self.orphan_m += a.held_m
        self.orphan_b += a.held_b

    def on_hello(self, key: Hashable, need: int, idle: bool, ret_m: int, ret_b: int) -> None:
        a = self.accounts[key]
        dm = max(0, min(ret_m - a.ret_m, a.unused_m))
        db = max(0, min(ret_b - a.ret_b, a.unused_b))
        a.ret_m += dm
        a.ret_b += db
        self.used_m -= dm
        self.used_b -= db
        need = need if need <= self.link_b else 0  # never satisfiable: ignore, do not freeze the pool
        if need and not a.need:
            a.need_order = next(self._order)
        a.need, a.idle = need, idle and not need

    def finish(self, key: Hashable) -> None:
        """End of stream: the link sends nothing more; its unused credit returns to the pool."""
        a = self.accounts[key]
        self.used_m -= a.unused_m
        self.used_b -= a.unused_b
        a.ret_m += a.unused_m
        a.ret_b += a.unused_b
        a.open, a.need = False, 0

    def sits_on_credit(self, key: Hashable) -> bool:
        """The link holds granted credit it has not used, and could send: it waits for nothing (a
        link still waiting for its `need` to be granted is blocked, not sitting on anything)."""
        a = self.accounts[key]
        if not a.open or (a.unused_m <= 0 and a.unused_b <= 0):
            return False
        return not a.need or (a.unused_m >= 1 and a.unused_b >= a.need)

    def can_accept(self, key: Hashable, nbytes: int) -> bool:
        a = self.accounts[key]  # (unused_m >= 1 and unused_b >= nbytes, written out: called per message)
        return a.open and a.lim_m - a.recv_m - a.ret_m >= 1 and a.lim_b - a.recv_b - a.ret_b >= nbytes

    def on_data(self, key: Hashable, nbytes: int) -> None:
        a = self.accounts[key]
        a.recv_m += 1
        a.recv_b += nbytes
        a.held_m += 1
        a.held_b += nbytes
        a.need, a.idle = 0, False

    def on_ack(self, key: Hashable, nbytes: int) -> None:
        a = self.accounts[key]
        a.held_m -= 1
        a.held_b -= nbytes
        self.used_m -= 1
        self.used_b -= nbytes

    def on_orphan_ack(self, nbytes: int) -> None:
        self.orphan_m -= 1
        self.orphan_b -= nbytes
        self.used_m -= 1
        self.used_b -= nbytes

    def _grant(self, a: Account, dm: int, db: int) -> None:
        a.lim_m += dm
        a.lim_b += db
        self.used_m += dm
        self.used_b += db

    def regrant(self) -> list[Hashable]:
        """Hand out free capacity (rules in the module docstring); returns links whose limits grew."""
        changed = []
        open_links = [(k, a) for k, a in self.accounts.items() if a.open]
        needy = sorted(((a.need_order, k, a) for k, a in open_links
                        if a.need and (a.unused_m < 1 or a.unused_b < a.need)), key=lambda t: t[0])
        for _, k, a in needy:
            dm, db = max(0, 1 - a.unused_m), max(0, a.need - a.unused_b)
            if a.held_m + a.unused_m + dm > self.link_m or a.held_b + a.unused_b + db > self.link_b:
                continue  # its own unacknowledged messages must go first; nobody else waits for them
            if dm > self.free_m or db > self.free_b:
                return changed  # keep what frees up for this producer
            self._grant(a, dm, db)
            changed.append(k)
        active = [(k, a) for k, a in open_links if not a.idle]
        if not active:
            return changed
        share_m = min(self.link_m, max(1, self.cap_m // len(active)))
        share_b = min(self.link_b, max(1, self.cap_b // len(active)))
        self._rr = (self._rr + 1) % len(active)
        for k, a in active[self._rr:] + active[:self._rr]:
            dm = min(self.free_m, max(0, share_m - a.unused_m - a.held_m))
            db = min(self.free_b, max(0, share_b - a.unused_b - a.held_b))
            if dm > 0 or db > 0:
                self._grant(a, max(dm, 0), max(db, 0))
                if k not in changed:
                    changed.append(k)
        return changed
