"""What a node process keeps across tickets: its checkpoints and the weights it publishes.

    state = NodeState(runner, version, fence, ...)
    if state.is_checkpoint_step(watermark): await state.save(watermark)   # -> `Checkpointed`
    state.expect_restore(epoch_order); await state.restore(epoch)          # a rollback, at the leader's word
    await state.publish()                                                   # a trainer's new version

Checkpoints: a stateful node saves its state when its in-order watermark reaches a checkpoint step
(or the run's end) and reports `Checkpointed`; it loads a checkpoint when it starts from one or
rolls back to one. Weights: a trainer (publisher) copies its weights out after each update for the
next broadcast. Everything that touches the node's state runs on the compute thread (`runner.py`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker.faults import FaultInjector
from flowrl.runtime.worker.inputs import Fence
from flowrl.runtime.worker.runner import NodeRunner
from flowrl.runtime.worker.version import WeightVersion


class NodeState:
    """Owns the checkpoint schedule (the run's end, the last save, the rollbacks ordered) and the
    node's state on disk; changes the weight version where the state says so."""

    def __init__(self, runner: NodeRunner, version: WeightVersion, fence: Fence, *, faults: FaultInjector,
                 recorder, report: Callable[[Any], Awaitable[None]], publishes: bool, run_dir: str,
                 log_name: str, steps: int, checkpoint_every: int, copy_dir: str | None = None):
        self._runner = runner
        self._version = version
        self._fence = fence
        self._faults = faults
        self._recorder = recorder
        self._report = report
        self._publishes = publishes
        self._dir = Path(run_dir) / "checkpoints"
        self._copy_dir = Path(copy_dir) / "checkpoints" if copy_dir else None  # launcher.checkpoint_uri
        self._log_name = log_name
        self._weights = None  # the WeightsClient, once made (after the node and its first checkpoint)
        self._restores: dict = {}  # epoch -> its Epoch order, restored when the leader says so
        self._saved_at = (-1, -1)  # (epoch, step) of the last checkpoint saved
        self._steps = steps  # the run's end (the final checkpoint)
        self._every = checkpoint_every

    def serve_weights(self, weights) -> None:
        """The weight client this process publishes with (a trainer's rank 0) or receives with."""
        self._weights = weights

    # checkpoints ----------------------------------------------------------------------------
    async def load(self, path: str) -> None:
        """Read and apply a checkpoint (one call on the compute thread); a trainer takes its version."""
        from flowrl.runtime.protocol.checkpoints import load_state

        def load() -> dict:
            state = load_state(Path(path))
            self._runner.node.load_state_dict(state["node"])
            return state

        state = await self._runner.run(load)
        if self._publishes:
            self._version.set(state.get("version", 0))

    def expect_restore(self, order: m.Epoch) -> None:
        """A rollback was ordered: it is done when the leader's step says so (`restore`)."""
        self._restores[order.epoch] = order

    async def restore(self, epoch: int) -> None:
        """Roll back to recovery epoch `epoch`'s committed checkpoint (its `Epoch` order), or, with
        nothing committed, to a fresh node; a trainer then snapshots the restored weights. Orders of
        older epochs are forgotten."""
        order = self._restores.pop(epoch, None)
        for e in [e for e in self._restores if e < epoch]:
            del self._restores[e]
        if order is None:
            return
        if order.checkpoint:
            await self.load(order.checkpoint)
        else:
            await self._runner.build()
            if self._weights is not None:  # the weights are the new node's
                self._weights.rebind(self._runner.node)
            self._version.set(0)
        if self._publishes:
            await self.publish_snapshot()

    @property
    def steps(self) -> int:
        return self._steps

    def is_checkpoint_step(self, watermark: int) -> bool:
        return watermark == self._steps or (self._every > 0 and watermark % self._every == 0)

    def move_end(self, steps: int) -> bool:
        """The run's end moved (replaced tickets): True when it did (its final checkpoint moves with it)."""
        if steps == self._steps:
            return False
        self._steps = steps
        return True

    def saved(self, step: int) -> bool:
        """Whether this epoch's checkpoint at `step` is saved already."""
        return self._saved_at == (self._fence.epoch, step)

    async def save(self, step: int) -> None:
        """Save the state as of watermark `step` (every ticket < step applied, none after)."""
        from flowrl.runtime.protocol.checkpoints import copy_file, file_digest, file_name, save_state

        self._faults.on_checkpoint(step)
        self._saved_at = (self._fence.epoch, step)
        name = file_name(self._log_name, step, self._fence.epoch)
        epoch, version = self._fence.epoch, self._version.value

        def save() -> tuple[str, int, str | None]:
            save_state(self._dir / name, self._runner.node.state_dict(), step=step, epoch=epoch, version=version)
            sha256, size = file_digest(self._dir / name)  # what the commit record names (a fetch checks it)
            copy = None
            if self._copy_dir is not None:  # the second copy, where every host can read it
                copy = str(copy_file(self._dir / name, self._copy_dir / name))
            return sha256, size, copy

        with self._recorder.span("checkpoint", step=step):
            sha256, size, copy = await self._runner.run(save)
        await self._report(m.Checkpointed(step=step, epoch=self._fence.epoch, file=name,
                                          version=max(self._version.value, 0), sha256=sha256, size=size, copy=copy))

    async def make_and_drop(self) -> None:
        """A checkpoint's state made and dropped: a follower that left the epoch its leader still
        saves in (`ranks.FollowUp`) takes part in whatever collective `state_dict` makes."""
        await self._runner.run(self._runner.node.state_dict)

    # weights --------------------------------------------------------------------------------
    async def publish(self) -> None:
        """A trainer's update made a new version: snapshot it; rank 0 announces it."""
        self._version.bump()
        await self.publish_snapshot()
        if self._weights is not None:  # the publisher (rank 0) announces the version
            await self._report(m.Published(version=self._version.value, epoch=self._fence.epoch,
                                           **self._weights.digest(self._version.value)))

    async def publish_snapshot(self) -> None:
        """Trainers: copy the weights out for the next broadcast. On a data-parallel trainer the
        full tensors are gathered from every rank, so the other ranks take part at the same point
        (the leader decides which: `ranks.py`, `GroupStep`)."""
        if self._weights is not None:
            await self._runner.run(self._weights.snapshot, self._version.value)
        else:
            await self._runner.run(drain_weights, self._runner.node)


def drain_weights(node) -> None:
    """A data-parallel trainer's rank > 0: take part in the gathers of the leader's snapshot."""
    drain = getattr(node.weights(), "drain", None)
    if drain is not None:
        drain()
