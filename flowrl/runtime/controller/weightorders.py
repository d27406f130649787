"""Weight-sync ordering (mixed into `Controller`): who takes part in which sync epoch, and when.

Weights go from rank 0 of each publisher (a trainer) to every rank of every subscriber over
torch.distributed (`weightsync.py` is the process side). The controller forms the group: a fresh
sync epoch, and a `Sync` order to every member for each version a publisher reports.

Membership follows the processes that exist. The members of an epoch are the live, wired weight
processes that `flowrl scale` has not removed. A new epoch is formed

- when one joins: a (re)started member is wired and no other member is still starting (so the
  members that start together join one epoch);
- when one leaves: it went down (exit, kill, missed heartbeats, a hung call, its rank group
  restarting) or `flowrl scale` removed it (`follow_members`). The new epoch's order fences the
  old one on every member (`WeightsClient.fence`): a publisher that waits for the departed
  member's ready, or forms a group with it, stops within a quarter second and serves the new
  epoch. A publisher left alone gets a one-member epoch (no broadcast), which fences as well;
- after a rollback (the end of a recovery epoch), and after a sync failed (a permanent one, a
  layout mismatch, fails the run; so do more than five failures in a row).
"""

from __future__ import annotations

import logging

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.controller.procs import Proc

log = logging.getLogger("flowrl.controller")


class WeightOrders:
    """The controller's weight-sync half: sync epochs, Sync orders, Published/Synced/SyncFailed."""

    def weight_procs(self) -> list[Proc]:
        """Rank 0 of each publisher (its weights are whole there) and every rank of every subscriber,
        less the replicas `flowrl scale` removed (stopping: they take part in nothing)."""
        return [p for p in self.procs if not p.retired and (
            (p.spec.node in self.publishers and p.spec.rank == 0) or p.spec.node in self.subscribers)]

    def sync_candidates(self) -> list[Proc]:
        """The weight processes that can take part in a sync now: up, READY and wired."""
        return [p for p in self.weight_procs() if p.ready and p.wired and p.down_since is None]

    def sync_timeout_s(self) -> float:
        """Each collective's timeout (forming the group, the broadcast), counted from the go."""
        return max(30.0, self.spec.supervision.deadline_s * 4)

    async def new_sync_epoch(self) -> None:
        """Form a fresh weight-sync group of every live member and send the newest weights."""
        members = self.sync_candidates()
        pubs = [p for p in members if p.spec.node in self.publishers]
        if not pubs:
            self.sync_members, self.sync_identities = [], frozenset()
            return
        self.sync_epoch += 1
        self.sync_members = pubs[:1] + [p for p in members if p.spec.node in self.subscribers]
        self.sync_identities = frozenset(p.identity for p in self.sync_members)
        log.info("weight-sync epoch %d: %s", self.sync_epoch, ", ".join(p.id for p in self.sync_members))
        if len(self.sync_members) < 2:  # nobody to send to; the order still fences the publisher's older epoch
            await self.send_sync(self.sync_members[0], self.scheduler.version, 0)
            return
        await self.order_sync(self.scheduler.version)

    async def follow_members(self) -> None:
        """A member left (down, or removed by `flowrl scale`): when who can take part is not who
        does, a new epoch without it (and with whoever became ready meanwhile). During a recovery
        the recovery's end forms the epoch."""
        if self.recovering is not None:
            return
        if frozenset(p.identity for p in self.sync_candidates()) != self.sync_identities:
            await self.new_sync_epoch()

    async def order_sync(self, version: int) -> None:
        if len(self.sync_members) < 2 or self.recovering is not None:
            return
        for rank, p in enumerate(self.sync_members):
            await self.send_sync(p, version, rank)

    async def send_sync(self, p: Proc, version: int, rank: int) -> None:
        pub = self.sync_members[0]
        await self.send(p, m.Sync(sync_epoch=self.sync_epoch, version=version, rank=rank,
                                  world_size=len(self.sync_members), store=[pub.spec.host_address, pub.store_port],
                                  timeout_s=self.sync_timeout_s()))

    async def on_weights(self, proc: Proc, msg) -> None:
        """A publisher's new version, or a member's sync result."""
        if isinstance(msg, m.Published):
            if msg.digest:
                self.ledger.write("weights", "-", 0, node=proc.id, version=msg.version, digest=msg.digest)
            if msg.epoch == self.book.epoch:
                self.scheduler.set_version(msg.version)
                await self.order_sync(msg.version)
        elif isinstance(msg, m.Synced):
            proc.version = msg.version
            if msg.sync_epoch == self.sync_epoch:
                self.sync_failures = 0
            if msg.digest:
                self.ledger.write("weights", "-", 0, node=proc.id, version=msg.version, digest=msg.digest)
        elif isinstance(msg, m.SyncFailed):
            current = msg.sync_epoch == self.sync_epoch
            # an older epoch's round ends this way whenever membership changed: expected, not a warning
            log.log(logging.WARNING if current or msg.permanent else logging.INFO, "weight sync failed at %s: %s",
                    proc.id, msg.error)
            if msg.permanent:
                self.fail(proc, f"cannot take the trainer's weights: {msg.error}; every node that holds the "
                                "policy must build the same model (share it with a YAML anchor under vars:)")
            elif current and self.recovering is None:
                self.sync_failures += 1
                if self.sync_failures > 5:
                    self.fail(proc, f"weight sync failed {self.sync_failures} times in a row; last: {msg.error}")
                else:
                    await self.new_sync_epoch()
