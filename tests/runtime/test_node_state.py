"""`NodeState` (flowrl/runtime/worker/nodestate.py) owns the checkpoint schedule and the node's
state on disk: checkpoint steps, the saved checkpoint of this epoch, a rollback done only at the
leader's word and only for the newest epoch ordered, and the run's end moved."""

from __future__ import annotations

import anyio

from flowrl.runtime.protocol import messages as m
from tests.runtime.worker_kit import Node, build, shape


def test_checkpoint_steps_are_every_nth_watermark_and_the_runs_end_which_can_move():
    async def main():
        kit = await build(shape(stateful=True), steps=10, checkpoint_every=4)
        assert [w for w in range(1, 13) if kit.state.is_checkpoint_step(w)] == [4, 8, 10, 12]
        assert not kit.state.move_end(10) and kit.state.move_end(11)
        assert kit.state.steps == 11 and kit.state.is_checkpoint_step(11) and not kit.state.is_checkpoint_step(10)
        kit.close()

    anyio.run(main)


def test_a_saved_checkpoint_is_reported_and_loads_back_into_the_node(tmp_path):
    async def main():
        node = Node()
        kit = await build(shape(stateful=True), node=node, run_dir=tmp_path, epoch=2)
        node.seen = ["t-0", "t-1"]
        await kit.state.save(2)
        (done,) = kit.reports
        assert isinstance(done, m.Checkpointed) and (done.step, done.epoch, done.version) == (2, 2, 0)
        assert kit.state.saved(2) and not kit.state.saved(3)
        node.seen = ["t-0", "t-1", "t-2"]
        await kit.state.load(str(tmp_path / "checkpoints" / done.file))
        assert node.seen == ["t-0", "t-1"]
        kit.close()

    anyio.run(main)


def test_a_rollback_restores_only_the_epoch_named_and_forgets_older_orders(tmp_path):
    async def main():
        builds = []

        class Fresh(Node):
            async def setup(self):
                builds.append(1)

        kit = await build(shape(stateful=True), node=Fresh(), run_dir=tmp_path)
        await kit.state.restore(1)  # nothing ordered: nothing happens
        kit.state.expect_restore(m.Epoch(epoch=1, watermark=0))
        kit.state.expect_restore(m.Epoch(epoch=2, watermark=0))
        await kit.state.restore(2)  # a fresh node (nothing committed); epoch 1's order is gone
        assert len(builds) == 2
        await kit.state.restore(1)
        assert len(builds) == 2
        kit.close()

    anyio.run(main)
