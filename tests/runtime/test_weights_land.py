"""`WeightsClient.land` on its own: the node's `before_weights` runs first, then the version becomes
live and `load_weights` follows; when making it live fails, `weights_failed` lets the node go on."""

import asyncio
from types import SimpleNamespace

import pytest

from flowrl.runtime.worker.weightsync import WeightsClient


class Node:
    def __init__(self):
        self.calls = []

    async def before_weights(self, version):
        self.calls.append(("before", version))

    def load_weights(self, tensors, version):
        self.calls.append(("load", version))

    def weights_failed(self, version):
        self.calls.append(("failed", version))


class Recorder:
    def span(self, *a, **k):
        import contextlib
        return contextlib.nullcontext()


def client(node, commit):
    c = WeightsClient.__new__(WeightsClient)
    c.node, c.recorder = node, Recorder()
    c.sub = SimpleNamespace(commit=commit, live={}, received=dict)
    return c


def test_a_version_lands_after_the_node_paused_and_a_failed_one_lets_it_go_on():
    node, landed = Node(), []
    asyncio.run(client(node, landed.append).land(3))
    assert node.calls == [("before", 3), ("load", 3)] and landed == [3]

    def broken(version):
        raise RuntimeError("loader failed")

    node = Node()
    with pytest.raises(RuntimeError, match="loader failed"):
        asyncio.run(client(node, broken).land(4))
    assert node.calls == [("before", 4), ("failed", 4)]  # never left paused
