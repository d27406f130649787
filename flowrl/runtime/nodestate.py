"""What a node process keeps across tickets (mixed into `Worker`): its checkpoints and its weights.

Checkpoints: a stateful node saves its state when its in-order watermark reaches a checkpoint step
(or the run's end) and reports `Checkpointed`; it loads a checkpoint when it starts from one or
rolls back to one. Weights: a trainer (publisher) copies its weights out after each update for the
next broadcast; a `Sync` order runs one weight-sync round (`weightsync.py`), after which a
subscriber takes the new version and releases the batches that waited for it (the version gate),
and an observer is shown the version.
"""

from __future__ import annotations

import time
from pathlib import Path

from flowrl.runtime import messages as m


class NodeState:
    """The worker's state half: checkpoint save/load, weight snapshots, weight sync."""

    # checkpoints ----------------------------------------------------------------------------
    def load_checkpoint(self, path: str) -> None:
        from flowrl.runtime.checkpoints import load_state

        state = load_state(Path(path))
        self.node.load_state_dict(state["node"])
        if self.cls.publishes_weights:
            self.version = state.get("version", 0)
            self.nctx.policy_version = self.version

    def is_checkpoint_step(self, watermark: int) -> bool:
        return watermark == self.steps or (self.checkpoint_every > 0 and watermark % self.checkpoint_every == 0)

    async def save_checkpoint(self, step: int) -> None:
        """Save the state as of watermark `step` (every ticket < step applied, none after)."""
        from flowrl.runtime.checkpoints import file_name, save_state

        self.faults.on_checkpoint(step)
        self.saved_at = (self.fence.epoch, step)
        name = file_name(self.spec.log_name, step, self.fence.epoch)
        with self.recorder.span("checkpoint", step=step):
            save_state(Path(self.spec.run_dir) / "checkpoints" / name, self.node.state_dict(), step=step,
                       epoch=self.fence.epoch, version=self.version)
        await self.send_ctl(m.Checkpointed(step=step, epoch=self.fence.epoch, file=name, version=max(self.version, 0)))

    # weights --------------------------------------------------------------------------------
    async def weight_sync(self, order: m.Sync) -> None:

        self.busy = (f"weight sync v{order.version}", time.monotonic())
        try:
            received = await self.weights.sync(order, self.version)
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
                await self.node.observe(received)
            finally:
                self.busy = None

    def publish_snapshot(self) -> None:
        """Trainers: copy the weights out for the next broadcast. On a data-parallel trainer the
        full tensors are gathered from every rank, so the other ranks take part at the same point."""
        if self.weights is not None:
            self.weights.snapshot(self.version)
        else:
            drain = getattr(self.node.weights(), "drain", None)
            if drain is not None:
                drain()
