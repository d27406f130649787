"""The node process hands each control order to one handler, chosen by the order's type
(flowrl/runtime/worker/worker.py, `handler_table`): every message the controller sends to a node
has one, and an order reaches its handler unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import anyio

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker.worker import handler_table


def _recording_parts(calls: list):
    def handler(name):
        async def call(msg):
            calls.append((name, msg))
        return call

    return SimpleNamespace(
        orders=SimpleNamespace(ticket=handler("ticket"), enter_epoch=handler("epoch"), progress=handler("progress")),
        syncs=SimpleNamespace(order=handler("sync"), apart_from=lambda h: h),
        turns=SimpleNamespace(order=handler("turn"))), handler


def test_every_order_the_controller_sends_a_node_has_a_handler():
    parts, handler = _recording_parts([])
    table = handler_table(parts, wire=handler("wire"), stop=handler("stop"), rewire=handler("rewire"))
    to_nodes = {cls for cls in m.message_types().values() if cls.direction == "controller -> node"}
    assert set(table) == to_nodes


def test_an_order_reaches_its_handler_by_type():
    calls: list = []
    parts, handler = _recording_parts(calls)
    table = handler_table(parts, wire=handler("wire"), stop=handler("stop"), rewire=handler("rewire"))
    orders = [m.Progress(complete_below=3, steps=10), m.Stop(), m.Disconnect(edge="a -> b", address="ipc://x")]

    async def main():
        for order in orders:
            await table[type(order)](order)

    anyio.run(main)
    assert calls == [("progress", orders[0]), ("stop", orders[1]), ("rewire", orders[2])]
