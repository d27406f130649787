"""`Outputs` (flowrl/runtime/worker/outputs.py): what a node returned carries the routing facts of
the work it came from; a drop becomes a marker naming the node; a sink's consumption is reported
with the staleness of what it consumed."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from flowrl.node import Drop
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker.contract import NodeContractError
from flowrl.runtime.worker.inputs import Item
from flowrl.transport import Batch
from tests.runtime.worker_kit import build, shape


def _item() -> Item:
    src = Batch(tensors={"x": np.arange(2)}, batch_id="t-3", attempt=2, index=3, epoch=1, min_version=4,
                policy_version=5)
    return Item.of_batch("in", src, None)


def test_outputs_carry_the_routing_facts_of_their_input_and_drops_name_the_node():
    async def main():
        kit = await build()
        out = kit.outputs.stamp(Batch(tensors={"y": np.arange(2)}), _item())
        assert (out.batch_id, out.attempt, out.index, out.epoch, out.min_version, out.policy_version) == \
            ("t-3", 2, 3, 1, 4, 5)
        dropped = kit.outputs.stamp(Drop("empty"), _item())
        assert dropped.drop == "n: empty" and dropped.batch_id == "t-3"
        with pytest.raises(NodeContractError, match="not stateful"):
            kit.outputs.stamp(Drop("later", replace=True), _item())
        kit.close()

    anyio.run(main)


def test_a_sink_reports_what_it_consumed_with_its_staleness():
    async def main():
        kit = await build(shape(sink=True))
        kit.version.set(7)
        await kit.outputs.consume(_item(), None)
        (done,) = kit.reports
        assert isinstance(done, m.Consumed) and (done.batch_id, done.staleness, done.dropped_by) == ("t-3", 2, None)
        kit.close()

    anyio.run(main)
