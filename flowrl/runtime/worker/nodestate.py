"""What a node process keeps across tickets (mixed into `Worker`): its checkpoints and its weights.

Checkpoints: a stateful node saves its state when its in-order watermark reaches a checkpoint step
(or the run's end) and reports `Checkpointed`; it loads a checkpoint when it starts from one or
rolls back to one. Weights: a trainer (publisher) copies its weights out after each update for the
next broadcast; a `Sync` order runs one weight-sync round (`weightsync.py`), after which a
subscriber takes the new version and releases the batches that waited for it (the version gate),
and an observer is shown the version. Everything that touches the node's state runs on the
compute thread (`compute.py`).
"""

from __future__ import annotations

import time
from pathlib import Path

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker.ranks import GroupStep


class NodeState:
    """The worker's state half: checkpoint save/load, weight snapshots, weight sync."""

    # checkpoints ----------------------------------------------------------------------------
    async def load_checkpoint(self, path: str) -> None:
        from flowrl.runtime.protocol.checkpoints import load_state

        def load() -> dict:
            state = load_state(Path(path))
            self.node.load_state_dict(state["node"])
            return state

        state = await self.compute.call(load)  # one hop: read and apply
        if self.cls.publishes_weights:
            self.version = state.get("version", 0)
            self.nctx.policy_version = self.version

    async def restore(self, epoch: int) -> None:
        """Roll back to recovery epoch `epoch`'s committed checkpoint (its `Epoch` order), or, with
        nothing committed, to a fresh node; a trainer then snapshots the restored weights. Orders of
        older epochs are forgotten."""
        order = self.restore_orders.pop(epoch, None)
        for e in [e for e in self.restore_orders if e < epoch]:
            del self.restore_orders[e]
        if order is None:
            return
        if order.checkpoint:
            await self.load_checkpoint(order.checkpoint)
        else:
            await self.new_node()
            self.version = 0
            self.nctx.policy_version = 0
        if self.cls.publishes_weights:
            await self.publish_snapshot()

    def is_checkpoint_step(self, watermark: int) -> bool:
        return watermark == self.steps or (self.checkpoint_every > 0 and watermark % self.checkpoint_every == 0)

    async def save_checkpoint(self, step: int) -> None:
        """Save the state as of watermark `step` (every ticket < step applied, none after)."""
        from flowrl.runtime.protocol.checkpoints import file_name, save_state

        self.faults.on_checkpoint(step)
        self.saved_at = (self.fence.epoch, step)
        name = file_name(self.spec.log_name, step, self.fence.epoch)
        def save() -> None:
            save_state(Path(self.spec.run_dir) / "checkpoints" / name, self.node.state_dict(), step=step,
                       epoch=epoch, version=version)

        epoch, version = self.fence.epoch, self.version
        with self.recorder.span("checkpoint", step=step):
            await self.compute.call(save)
        await self.send_ctl(m.Checkpointed(step=step, epoch=self.fence.epoch, file=name, version=max(self.version, 0)))

    # weights --------------------------------------------------------------------------------
    async def weight_sync(self, order: m.Sync) -> None:
        """A `Sync` order. Every rank of a data-parallel subscriber is a member of the sync group, a
        collective: the ranks join it when their leader says (a `GroupStep`), never while another
        rank waits for them in a step of its own."""
        if self.dp and self.cls.subscribes_weights:
            if self.spec.rank > 0:  # kept until the leader's step names this sync epoch
                self.sync_orders = {e: o for e, o in self.sync_orders.items() if e > order.sync_epoch - 8}
                self.sync_orders[order.sync_epoch] = order
                if self.awaiting_sync == order.sync_epoch:
                    await self.join_sync(order.sync_epoch)
                return
            if not await self.lead(None, GroupStep(sync=order.sync_epoch), epoch=self.fence.epoch, marker="sync"):
                return  # a rank is in a newer recovery epoch: the recovery forms a new sync epoch
        await self.sync_now(order)

    async def join_sync(self, sync_epoch: int) -> None:
        """A follower's part of its leader's sync step (its own `Sync` order may come later)."""
        order = self.sync_orders.pop(sync_epoch, None)
        self.awaiting_sync = None if order is not None else sync_epoch
        if order is not None:
            await self.sync_now(order)

    async def sync_now(self, order: m.Sync) -> None:
        self.busy = (f"weight sync v{order.version}", time.monotonic())
        try:
            received = await self.weights.sync(order, self.version, self.compute)
        except Exception as e:  # noqa: BLE001 - reported; the controller forms a new epoch
            from flowrl.weights import LayoutMismatchError

            await self.send_ctl(m.SyncFailed(sync_epoch=order.sync_epoch, error=str(e)[:2000],
                                             permanent=isinstance(e, LayoutMismatchError)))
            return
        finally:
            self.busy = None
        if not self.cls.publishes_weights:
            self.version = received
            self.nctx.policy_version = received
        await self.send_ctl(m.Synced(version=received, sync_epoch=order.sync_epoch, **self.weights.digest()))
        for arrival in self.gate.release(self.version):
            await self.on_arrival(arrival)
        if self.is_observer:
            self.busy = (f"observe v{received}", time.monotonic())
            try:
                await self.compute.call(self.node.observe, received)
            finally:
                self.busy = None

    async def publish_snapshot(self) -> None:
        """Trainers: copy the weights out for the next broadcast. On a data-parallel trainer the
        full tensors are gathered from every rank, so the other ranks take part at the same point
        (the leader decides which: `ranks.py`, `GroupStep`)."""
        if self.weights is not None:
            await self.compute.call(self.weights.snapshot, self.version)
        else:
            await self.compute.call(drain_weights, self.node)


def drain_weights(node) -> None:
    """A data-parallel trainer's rank > 0: take part in the gathers of the leader's snapshot."""
    drain = getattr(node.weights(), "drain", None)
    if drain is not None:
        drain()
