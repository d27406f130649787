"""`OrderTaker` (flowrl/runtime/worker/orders.py): a rollback drops the old epoch's work (acked, so
credit returns), holds a subscriber's batches until the restored weights come, and restores the
state at the leader's word; an order sent again changes nothing; the run's end moving to where a
stateful node already is saves its final checkpoint now."""

from __future__ import annotations

import anyio
import numpy as np

from flowrl.runtime.protocol import messages as m
from flowrl.transport import Batch
from tests.runtime.worker_kit import Node, Rx, build, shape


def _batch(index: int, epoch: int = 0, min_version: int = 0) -> Batch:
    return Batch(tensors={"x": np.arange(2)}, batch_id=f"t-{index}", index=index, epoch=epoch, min_version=min_version)


def test_a_rollback_drops_the_old_epochs_work_and_runs_what_was_held_for_the_new_one():
    async def main():
        kit = await build(shape(subscribes=True), weights=object())
        rx = Rx()
        await kit.path.on_arrival(("in", _batch(1, min_version=3), rx))  # waits for weights
        await kit.path.on_arrival(("in", _batch(2, epoch=1), rx))  # of the next epoch: held
        await kit.orders.enter_epoch(m.Epoch(epoch=1, watermark=0))
        assert rx.acked == ["t-1"] and kit.orders.epoch == 1 and kit.version.value == -1
        dup, recovered = kit.reports[0], kit.reports[1]
        assert (dup.batch_id, dup.why) == ("t-1", "recovery") and recovered == m.Recovered(epoch=1)
        assert kit.runner.node.seen == []  # t-2 waits for the restored weights now
        kit.close()

    anyio.run(main)


def test_an_epoch_order_sent_again_changes_nothing():
    async def main():
        kit = await build(shape(stateful=True), epoch=2)
        await kit.orders.enter_epoch(m.Epoch(epoch=2, watermark=5))
        assert kit.reports == [m.Recovered(epoch=2)] and kit.path.watermark == 0
        kit.close()

    anyio.run(main)


def test_a_stateful_leader_restores_its_state_in_the_new_epoch(tmp_path):
    async def main():
        node = Node()
        kit = await build(shape(stateful=True), node=node, run_dir=tmp_path)
        node.seen = ["t-0"]
        await kit.state.save(1)
        ckpt = kit.reports[-1]
        node.seen = ["t-0", "t-1", "t-2"]
        await kit.orders.enter_epoch(m.Epoch(epoch=1, watermark=1, checkpoint=str(tmp_path / "checkpoints" / ckpt.file)))
        assert node.seen == ["t-0"] and kit.path.watermark == 1
        kit.close()

    anyio.run(main)


def test_the_runs_end_moving_to_where_a_stateful_node_is_saves_its_final_checkpoint(tmp_path):
    async def main():
        kit = await build(shape(stateful=True), run_dir=tmp_path, watermark=6, steps=8)
        await kit.orders.progress(m.Progress(complete_below=6, steps=6))
        (done,) = kit.reports
        assert isinstance(done, m.Checkpointed) and done.step == 6
        await kit.orders.progress(m.Progress(complete_below=6, steps=6))  # the same end: nothing
        assert len(kit.reports) == 1
        kit.close()

    anyio.run(main)
