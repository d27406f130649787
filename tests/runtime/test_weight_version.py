"""The weight version of a node process has one writer, `WeightVersion` (flowrl/runtime/worker/
version.py), and the node's context (`ctx.policy_version`, what the user's node reads) agrees with
it after every change: a publish, a checkpoint load, a rollback with nothing committed, a weight
sync, a subscriber's rollback. Before, the context was updated by hand at only some of them."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker.version import UNKNOWN, WeightVersion
from tests.runtime.worker_kit import Node, build, shape

WORKER = Path(__file__).resolve().parents[2] / "flowrl" / "runtime" / "worker"


def test_every_change_of_the_version_is_seen_by_the_node_context():
    ctx = SimpleNamespace(policy_version=5)
    v = WeightVersion(ctx)
    assert v.value == ctx.policy_version == 0
    assert v.bump() == 1 and ctx.policy_version == 1
    v.set(7)
    assert v.value == ctx.policy_version == 7
    v.forget()
    assert v.value == ctx.policy_version == UNKNOWN


def test_the_version_cannot_be_assigned_around_its_owner():
    v = WeightVersion(SimpleNamespace(policy_version=0))
    with pytest.raises(AttributeError):
        v.value = 3  # type: ignore[misc]


def test_no_module_of_the_node_process_writes_a_version_but_its_owner():
    """Any `x.version = ...`, `x.policy_version += ...` (a number kept beside the owner, or the context
    written by hand) outside version.py fails here; handing the `WeightVersion` object in
    (`self._version = version`) is fine."""
    found = []
    for path in sorted(WORKER.glob("*.py")):
        if path.name == "version.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for sub in ast.walk(t):
                        passed_on = isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) \
                            and node.value.id == "version"  # `self._version = version`: the owner, handed in
                        if isinstance(sub, ast.Attribute) and "version" in sub.attr and not passed_on:
                            found.append(f"{path.name}:{node.lineno} assigns .{sub.attr}")
    assert found == [], "the weight version has one writer, WeightVersion (version.py): " + "; ".join(found)


def test_every_path_that_changes_the_version_updates_the_node_context(tmp_path):
    """Each path of the node process that changes the version, through the components that own it."""

    class Weights:
        def __init__(self):
            self.snapshots = []

        def snapshot(self, version):
            self.snapshots.append(version)

        def digest(self, version):
            return {}

        def rebind(self, node):
            pass

        async def sync(self, order, version, runner):
            return order.version

        def fence(self, epoch):
            pass

    async def main():
        # a trainer publishes (a sink that publishes weights), then loads a checkpoint, then rolls
        # back to a fresh node
        trainer = await build(shape(sink=True, stateful=True, publishes=True), node=Node(), run_dir=tmp_path,
                              weights=Weights())
        await trainer.state.publish()
        assert trainer.version.value == trainer.ctx.policy_version == 1
        await trainer.state.publish()
        await trainer.state.save(2)
        await trainer.state.publish()
        assert trainer.ctx.policy_version == 3
        (ckpt,) = [r for r in trainer.reports if isinstance(r, m.Checkpointed)]
        await trainer.state.load(str(tmp_path / "checkpoints" / ckpt.file))
        assert trainer.version.value == trainer.ctx.policy_version == 2
        trainer.state.expect_restore(m.Epoch(epoch=1, watermark=0, checkpoint=None, consumed=[]))
        await trainer.state.restore(1)
        assert trainer.version.value == trainer.ctx.policy_version == 0
        trainer.close()
        # a subscriber syncs, then rolls back (its weights no longer count), then syncs again
        rollout = await build(shape(subscribes=True), weights=Weights())
        await rollout.syncs.order(m.Sync(version=4, sync_epoch=1, rank=1, world_size=2, store=["h", 1],
                                         timeout_s=1.0))
        assert rollout.version.value == rollout.ctx.policy_version == 4
        await rollout.orders.enter_epoch(m.Epoch(epoch=1, watermark=0, checkpoint=None, consumed=[]))
        assert rollout.version.value == rollout.ctx.policy_version == UNKNOWN
        rollout.close()

    anyio.run(main)
