"""Weight-sync ordering (mixed into `Controller`): who takes part in which sync epoch, and when.

Weights go from rank 0 of each publisher (a trainer) to every rank of every subscriber over
torch.distributed (`weightsync.py` is the process side). The controller forms the group: a fresh
sync epoch of every live, wired member whenever membership changes (a start, a restart, the end
of a recovery, a scale), and a `Sync` order to every member for each version a publisher reports.
A failed sync forms a new epoch (a permanent one, a layout mismatch, fails the run; so do more
than five failures in a row).
"""

from __future__ import annotations

import logging

from flowrl.runtime import messages as m
from flowrl.runtime.procs import Proc

log = logging.getLogger("flowrl.controller")


class WeightOrders:
    """The controller's weight-sync half: sync epochs, Sync orders, Published/Synced/SyncFailed."""

    def weight_procs(self) -> list[Proc]:
        """Rank 0 of each publisher (its weights are whole there) and every rank of every subscriber."""
        return [p for p in self.procs if (p.spec.node in self.publishers and p.spec.rank == 0)
                or p.spec.node in self.subscribers]

    async def new_sync_epoch(self) -> None:
        """Form a fresh weight-sync group of every live member and send the newest weights."""
        members = [p for p in self.weight_procs() if p.ready and p.wired and p.down_since is None]
        pubs = [p for p in members if p.spec.node in self.publishers]
        if not pubs or len(members) < 2:
            self.sync_members = []
            return
        self.sync_epoch += 1
        self.sync_members = pubs[:1] + [p for p in members if p.spec.node in self.subscribers]
        await self.order_sync(self.scheduler.version)

    async def order_sync(self, version: int) -> None:
        if not self.sync_members or self.recovering is not None:
            return
        pub = self.sync_members[0]
        sup = self.spec.supervision
        for rank, p in enumerate(self.sync_members):
            await self.send(p, m.Sync(sync_epoch=self.sync_epoch, version=version, rank=rank,
                                      world_size=len(self.sync_members), store=[pub.spec.host_address, pub.store_port],
                                      timeout_s=max(30.0, sup.deadline_s * 4)))

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
            self.sync_failures = 0
            if msg.digest:
                self.ledger.write("weights", "-", 0, node=proc.id, version=msg.version, digest=msg.digest)
        elif isinstance(msg, m.SyncFailed):
            log.warning("weight sync failed at %s: %s", proc.id, msg.error)
            if msg.permanent:
                self.fail(proc, f"cannot take the trainer's weights: {msg.error}; every node that holds the "
                                "policy must build the same model (share it with a YAML anchor under vars:)")
            elif msg.sync_epoch == self.sync_epoch and self.recovering is None:
                self.sync_failures += 1
                if self.sync_failures > 5:
                    self.fail(proc, f"weight sync failed {self.sync_failures} times in a row; last: {msg.error}")
                else:
                    await self.new_sync_epoch()
