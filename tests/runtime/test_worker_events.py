"""The node process's event queue (flowrl/runtime/worker/events.py): arrival order, and no turn of the
event loop spent on an event that is already there."""

from __future__ import annotations

import asyncio

from flowrl.runtime.worker.events import Events


def test_events_come_out_in_arrival_order_whatever_their_kind():
    async def main():
        events = Events()
        events.put(("data", "in", "b1", None))
        events.put(("ctl", "progress"))
        events.put(("error", "e"))
        assert len(events) == 3
        got = [events.take_nowait(), await events.take(), events.take_nowait()]
        assert got == [("data", "in", "b1", None), ("ctl", "progress"), ("error", "e")]
        assert events.take_nowait() is None

    asyncio.run(main())


def test_a_queued_event_is_taken_without_yielding_and_an_empty_queue_waits_for_the_next_put():
    async def main():
        events = Events()
        ran = []
        asyncio.get_running_loop().call_soon(ran.append, "other work")
        events.put(("ctl", 1))
        assert await events.take() == ("ctl", 1) and ran == []  # no turn of the loop went by
        waiter = asyncio.create_task(events.take())
        await asyncio.sleep(0)
        assert not waiter.done() and ran == ["other work"]
        events.put(("data", 2))
        events.put(("data", 3))
        assert await asyncio.wait_for(waiter, 5) == ("data", 2)
        assert await events.take() == ("data", 3)

    asyncio.run(main())
