"""`NodeRunner` (flowrl/runtime/worker/runner.py) owns the node and every call into it: calls run
on the compute thread, one count per call, and `busy` (what the heartbeat reports) says which call
runs since when, is kept by a nested mark, and is cleared whatever the call's outcome."""

from __future__ import annotations

import threading

import anyio
import pytest

from flowrl.metrics import Recorder
from flowrl.runtime.worker.compute import ComputeThread
from flowrl.runtime.worker.faults import FaultInjector
from flowrl.runtime.worker.runner import NodeRunner


class Node:
    def __init__(self, seen: list):
        self.seen = seen

    async def setup(self):
        self.seen.append(("setup", threading.current_thread().name))

    def process(self, batch, port):
        self.seen.append(("process", threading.current_thread().name))
        if batch == "bad":
            raise ValueError("bad batch")
        return batch


def _runner(seen: list) -> NodeRunner:
    return NodeRunner(ComputeThread("t"), FaultInjector([], "n", 0), Recorder("n"), make=lambda: Node(seen))


def test_the_node_is_built_and_called_on_the_compute_thread_and_each_call_counts():
    seen: list = []
    runner = _runner(seen)

    async def main():
        await runner.build()
        assert await runner.call("t-1", runner.node.process, "x", "in") == "x"
        assert runner.calls == 1 and runner.busy is None

    anyio.run(main)
    assert [w for w, _ in seen] == ["setup", "process"]
    assert all(thread == "flowrl-compute-t" for _, thread in seen)


def test_busy_names_the_call_in_flight_keeps_an_outer_mark_and_clears_after_an_error():
    runner = _runner([])

    async def main():
        await runner.build()
        with runner.occupied("t-7"):  # a leader waiting for its followers, then its own shard
            assert runner.busy[0] == "t-7"
            await runner.call("t-8", runner.node.process, "x", "in")
            assert runner.busy[0] == "t-7"
        assert runner.busy is None
        with pytest.raises(ValueError):
            await runner.call("t-9", runner.node.process, "bad", "in")
        assert runner.busy is None and runner.failed_on == "t-9" and runner.calls == 2

    anyio.run(main)
