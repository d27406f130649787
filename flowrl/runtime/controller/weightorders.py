"""The weight-sync group: who takes part in which sync epoch, and when.

Weights go from rank 0 of each publisher (a trainer) to every rank of every subscriber over
torch.distributed (`weightsync.py` is the process side). The controller forms the group: a fresh
sync epoch, and a `Sync` order to every member for each version a publisher reports.

Membership follows the processes that exist. The members of an epoch are the live, wired weight
processes that `flowrl scale` has not removed. A new epoch is formed

- when one joins: a (re)started member is wired and no other member is still starting (so the
  members that start together join one epoch);
- when one leaves: it went down (exit, kill, missed heartbeats, a hung call, its rank group
  restarting) or `flowrl scale` removed it (`follow`). The new epoch's order fences the
  old one on every member (`WeightsClient.fence`): a publisher that waits for the departed
  member's ready, or forms a group with it, stops within a quarter second and serves the new
  epoch. A publisher left alone gets a one-member epoch (no broadcast), which fences as well;
- after a rollback (the end of a recovery epoch), and after a sync failed (a permanent one, a
  layout mismatch, fails the run; so do more than `controller.weight_sync.max_failures` in a row).

An epoch whose subscribers all share the publisher's device (`colocated`: declared with
`colocate_with`, one host, the same devices or one take-turns group) is a handoff epoch: its orders say `handoff` and the weights go
by the publisher's shared region, not a broadcast (flowrl.weights.handoff; FLOWRL_WEIGHT_HANDOFF=0
in the controller's environment turns it off).

The group is the one writer of its members, their identities, the sync epoch and the failure
count. Whether a recovery runs (no orders then) and the newest version come in as arguments.

    group = SyncGroup(procs, roles, send=socket.send, fail=outcome.fail, ledger=ledger,
                      section=spec.controller.weight_sync, deadline_s=spec.supervision.deadline_s)
    await group.form(version)                          # a fresh epoch of every live member
    await group.follow(version, recovering=False)      # a member left or came: a new epoch if so
"""

from __future__ import annotations

import logging
import os
import time
from typing import Awaitable, Callable

from flowrl.graph.spec import WeightSyncSpec
from flowrl.runtime.controller.procs import Proc, ProcTable
from flowrl.runtime.controller.roles import Roles
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.ledger import WeightsHeld

log = logging.getLogger("flowrl.controller")


def colocated(a: Proc, b: Proc) -> bool:
    """Whether two processes share a device: declared colocated (`colocate_with`), on one host, and
    in one take-turns group or on the same devices."""
    x, y = a.spec, b.spec
    if x.colocation is None or x.colocation != y.colocation or x.host_address != y.host_address:
        return False
    return x.device_type == y.device_type and (x.turn_group is not None or x.devices == y.devices)

ROUND_QUIET_S = 0.5  # the longest the controller's metrics work waits for a round's replies

Send = Callable[[Proc, object], Awaitable[bool]]
Fail = Callable[[Proc | None, str], None]


class SyncGroup:
    def __init__(self, procs: ProcTable, roles: Roles, *, send: Send, fail: Fail, ledger, section: WeightSyncSpec,
                 deadline_s: float):
        self.procs = procs
        self.roles = roles
        self.send = send
        self.fail = fail
        self.ledger = ledger
        self.section = section
        self.deadline_s = deadline_s
        self.epoch = 0
        self.failures = 0  # failed rounds of the current epoch in a row
        self.members: list[Proc] = []
        self.identities: frozenset[bytes] = frozenset()  # who the current sync epoch was formed of
        self.handoff = False  # the current epoch's members all share the publisher's device
        self.awaited: set[bytes] = set()  # members of the last ordered round not yet synced or failed
        self.ordered_at = 0.0  # when that round was ordered (monotonic)

    # membership -------------------------------------------------------------------------------
    def weight_procs(self) -> list[Proc]:
        """Rank 0 of each publisher (its weights are whole there) and every rank of every subscriber,
        less the replicas `flowrl scale` removed (stopping: they take part in nothing)."""
        pubs, subs = self.roles.publishers, self.roles.subscribers
        return [p for p in self.procs if not p.retired and (
            (p.spec.node in pubs and p.spec.rank == 0) or p.spec.node in subs)]

    def candidates(self) -> list[Proc]:
        """The weight processes that can take part in a sync now: up, READY and wired."""
        return [p for p in self.weight_procs() if p.ready and p.wired and p.down_since is None]

    def timeout_s(self) -> float:
        """Each collective's timeout (forming the group, the broadcast), counted from the go."""
        return max(self.section.min_timeout_s, self.deadline_s * self.section.timeout_deadlines)

    async def form(self, version: int) -> None:
        """Form a fresh weight-sync group of every live member and send the newest weights."""
        members = self.candidates()
        pubs = [p for p in members if p.spec.node in self.roles.publishers]
        if not pubs:
            self.members, self.identities = [], frozenset()
            return
        self.epoch += 1
        self.members = pubs[:1] + [p for p in members if p.spec.node in self.roles.subscribers]
        self.identities = frozenset(p.identity for p in self.members)
        self.handoff = os.environ.get("FLOWRL_WEIGHT_HANDOFF", "1") != "0" and len(self.members) > 1 and all(
            colocated(self.members[0], p) for p in self.members[1:])
        log.info("weight-sync epoch %d%s: %s", self.epoch, " (handoff on one device)" if self.handoff else "",
                 ", ".join(p.id for p in self.members))
        if len(self.members) < 2:  # nobody to send to; the order still fences the publisher's older epoch
            await self._send_sync(self.members[0], version, 0)
            return
        await self.order(version, recovering=False)

    async def joined(self, proc: Proc, version: int) -> None:
        """`proc` is wired: a weight process joins the next epoch, with every other member now starting."""
        if proc in self.weight_procs():
            if all(p.ready and p.wired for p in self.weight_procs() if p.down_since is None):
                await self.form(version)

    async def follow(self, version: int, *, recovering: bool) -> None:
        """A member left (down, or removed by `flowrl scale`): when who can take part is not who
        does, a new epoch without it (and with whoever became ready meanwhile). During a recovery
        the recovery's end forms the epoch."""
        if recovering:
            return
        if frozenset(p.identity for p in self.candidates()) != self.identities:
            await self.form(version)

    def disband(self) -> None:
        """A recovery began: no group until its end forms one."""
        self.members, self.identities, self.awaited = [], frozenset(), set()

    def drop(self, proc: Proc) -> None:
        """`proc` is gone for good (a removed replica): it is no member any more."""
        self.members = [p for p in self.members if p is not proc]
        self.awaited.discard(proc.identity)

    # orders and results -----------------------------------------------------------------------
    async def order(self, version: int, *, recovering: bool) -> None:
        """Every member syncs `version` (nothing during a recovery, nor with fewer than two)."""
        if len(self.members) < 2 or recovering:
            return
        self.awaited, self.ordered_at = {p.identity for p in self.members}, time.monotonic()
        for rank, p in enumerate(self.members):
            await self._send_sync(p, version, rank)

    def in_round(self) -> bool:
        """A round this group ordered is under way: its members' replies have not all come, and it
        was ordered less than ROUND_QUIET_S ago. The controller holds its metrics work meanwhile: a
        round is on every subscriber's path, and on two cores that work took a core from it."""
        return bool(self.awaited) and time.monotonic() - self.ordered_at < ROUND_QUIET_S

    async def _send_sync(self, p: Proc, version: int, rank: int) -> None:
        pub = self.members[0]
        await self.send(p, m.Sync(sync_epoch=self.epoch, version=version, rank=rank, world_size=len(self.members),
                                  store=[pub.spec.host_address, pub.store_port], timeout_s=self.timeout_s(),
                                  handoff=self.handoff))

    def synced(self, proc: Proc, msg: m.Synced) -> None:
        self.awaited.discard(proc.identity)
        proc.version = msg.version
        if msg.sync_epoch == self.epoch:
            self.failures = 0
        if msg.digest:
            self.ledger.record(WeightsHeld(node=proc.id, version=msg.version, digest=msg.digest))

    async def sync_failed(self, proc: Proc, msg: m.SyncFailed, version: int, *, recovering: bool) -> None:
        self.awaited.discard(proc.identity)
        current = msg.sync_epoch == self.epoch
        # an older epoch's round ends this way whenever membership changed: expected, not a warning
        log.log(logging.WARNING if current or msg.permanent else logging.INFO, "weight sync failed at %s: %s",
                proc.id, msg.error)
        if msg.permanent:
            self.fail(proc, f"cannot take the trainer's weights: {msg.error}; every node that holds the "
                            "policy must build the same model (share it with a YAML anchor under vars:)")
        elif current and not recovering:
            self.failures += 1
            if self.failures > self.section.max_failures:
                self.fail(proc, f"weight sync failed {self.failures} times in a row; last: {msg.error} "
                                "(controller.weight_sync.max_failures)")
            else:
                await self.form(version)
