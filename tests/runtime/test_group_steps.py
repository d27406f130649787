"""`GroupSteps` (flowrl/runtime/worker/steps.py) does a group step on this rank in the one order every
rank does it (restore, publish, checkpoint, sync), and keeps a rollback ordered before the leader
could reach its followers until it can; the data path's `after_ticket` is the one place that
decides a ticket's step (docs/data-parallel.md, "who decides each collective")."""

from __future__ import annotations

import anyio

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker.inputs import Item
from flowrl.runtime.worker.ranks import GroupStep
from tests.runtime.worker_kit import Node, Rx, Tx, build, shape


class Weights:
    def __init__(self):
        self.snapshots = []

    def snapshot(self, version):
        self.snapshots.append(version)

    def rebind(self, node):
        pass

    def digest(self, version):
        return {}


def test_a_step_restores_then_publishes_then_saves_on_this_rank(tmp_path):
    async def main():
        weights = Weights()
        kit = await build(shape(sink=True, stateful=True, publishes=True), node=Node(), run_dir=tmp_path,
                          weights=weights)
        kit.state.expect_restore(m.Epoch(epoch=0, watermark=0))
        await kit.steps.follow(GroupStep(restore=True, publish=True, checkpoint=1))
        assert weights.snapshots == [0, 1]  # the restored weights, then the new version
        assert [type(r).__name__ for r in kit.reports] == ["Published", "Checkpointed"]
        assert kit.reports[1].version == kit.reports[0].version == 1
        kit.close()

    anyio.run(main)


def test_a_rollback_before_the_followers_are_reached_waits_until_they_are(tmp_path):
    """The leader hands the step to its followers (they answer `accept`) before any rank does it."""
    async def main():
        rx = Rx()
        kit = await build(shape(stateful=True), run_dir=tmp_path, world_size=2, rank_rx=rx)
        await kit.steps.take_rollback(GroupStep(checkpoint=0), epoch=0)
        assert kit.reports == []  # deferred: no follower to tell yet
        to1 = Tx()
        kit.ranks.add_peer(1, to1)
        async def recv():
            (marker,) = to1.sent
            return marker.replace(meta={"_rank": 1, "_reply": "accept"}, drop=None)

        rx.recv = recv
        await kit.steps.wired()
        assert [type(r).__name__ for r in kit.reports] == ["Checkpointed"]
        assert to1.sent[-1].meta["_verdict"] == "go"
        kit.close()

    anyio.run(main)


def test_after_a_ticket_a_trainer_publishes_and_a_stateful_node_saves_at_checkpoint_steps():
    async def main():
        trainer = await build(shape(sink=True, stateful=True, publishes=True), checkpoint_every=2)
        item = Item(index=1, batch_id="t-1", attempt=0, epoch=0)
        assert trainer.path.after_ticket(item) == GroupStep(publish=True, checkpoint=2)
        assert trainer.path.after_ticket(Item(index=2, batch_id="t-2", attempt=0, epoch=0)).checkpoint is None
        stateless = await build(shape(), checkpoint_every=2)
        assert stateless.path.after_ticket(item) == GroupStep()
        trainer.close()
        stateless.close()

    anyio.run(main)
