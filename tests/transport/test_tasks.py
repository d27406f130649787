"""A channel's background work has an owner (tasks.py): its tasks run in a task group, `aclose()`
ends every one of them before it returns, and a task that fails ends the owner's group instead of
dying unseen. Both ends live in the test process; steps are ordered on the channels' own state.
"""

from __future__ import annotations

import asyncio

import anyio
import numpy as np
import pytest

from flowrl.transport import Batch, Receiver, Sender
from tests.transport.helpers import fast_config, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class Boom(Exception):
    """What a failing background task raises."""


async def boom(*_args) -> None:
    raise Boom("a background task failed")


def batch(i: int) -> Batch:
    return Batch(tensors={"x": np.full(4, i)}, batch_id=f"p{i}")


def tasks_of(end: str) -> set:
    """The tasks of the channel end `end` ("sender 'e'"), by the names tasks.py gives them."""
    return {t for t in asyncio.all_tasks() if t.get_name().startswith(f"flowrl channel {end}")}


def running(tasks: set) -> list:
    return [t for t in tasks if not t.done()]


async def test_a_closed_receiver_leaves_no_task_running_even_with_its_ack_timer_armed(tmp_path):
    cfg = fast_config(capacity_messages=64)  # acknowledgements go 16 at a time, or ACK_DELAY_S after the first
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as tx:
        address = await rx.bind(f"ipc://{tmp_path}/ch")
        await tx.connect(address)
        await tx.send(batch(0))
        await rx.ack(await rx.recv())
        assert rx._unflushed == 1  # the acknowledgement waits for company: the timer is armed
        mine = tasks_of("receiver 'e'")  # its host, heartbeats and acknowledgement timer
        await rx.aclose()
        assert len(mine) == 3 and not running(mine)


async def test_a_closed_sender_leaves_no_task_running_even_with_a_lost_links_memory_waiting_to_close(tmp_path):
    cfg = fast_config(peer_timeout_s=30.0)  # the memory of a disconnected link lingers this long
    with anyio.fail_after(10):  # the owner's group ends by itself: nothing of the channels keeps it open
        async with Receiver(cfg, name="e") as rx, anyio.create_task_group() as tg:
            address = await rx.bind(f"ipc://{tmp_path}/ch")
            tx = Sender(cfg, name="e", task_group=tg)
            await tx.connect(address)
            await tx.send(batch(0))
            await rx.ack(await rx.recv())
            await tx.disconnect(address)
            assert len(tx._lingering) == 1  # its shared memory closes in peer_timeout_s, or at aclose()
            await wait_until(lambda: len(tasks_of("sender 'e'")) == 3)  # host, heartbeats, closing that memory
            mine = tasks_of("sender 'e'")
            await tx.aclose()
            assert not running(mine)
            assert tx._lingering[0]._closed


async def test_a_receiver_given_a_task_group_ends_its_tasks_on_aclose(tmp_path):
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            rx = Receiver(fast_config(), name="e", task_group=tg)
            await rx.bind(f"ipc://{tmp_path}/ch")
            await wait_until(lambda: len(tasks_of("receiver 'e'")) == 3)  # host, heartbeats, acknowledgement timer
            mine = tasks_of("receiver 'e'")
            await rx.aclose()
            assert not running(mine)


@pytest.mark.parametrize("end", ["sender", "receiver"])
async def test_a_background_task_that_fails_ends_the_group_it_runs_in(end, tmp_path):
    with anyio.fail_after(10), pytest.raises(BaseExceptionGroup) as caught:
        async with Receiver(fast_config(), name="e") as rx, Sender(fast_config(), name="e") as tx:
            if end == "sender":
                tx._tick_loop = boom
            else:
                rx._tick_loop = boom
            await tx.connect(await rx.bind(f"ipc://{tmp_path}/ch"), wait=False)
            await anyio.sleep_forever()  # the failure cancels this
    assert caught.group_contains(Boom, depth=None)


async def test_a_resend_that_fails_reaches_the_task_group_of_the_senders_owner(tmp_path):
    cfg = fast_config(capacity_messages=8)
    with anyio.fail_after(10), pytest.raises(BaseExceptionGroup) as caught:
        async with Receiver(cfg, name="e") as rx, anyio.create_task_group() as tg:
            tx = Sender(cfg, name="e", task_group=tg)
            try:
                await tx.connect(await rx.bind(f"ipc://{tmp_path}/ch"))
                await tx.send(batch(0))
                await wait_until(lambda: rx.statistics().received == 1)
                tx._drain_pending = boom
                await rx.aclose()  # the consumer leaves; what it did not acknowledge is re-sent (here: fails)
                await anyio.sleep_forever()
            finally:
                await tx.aclose()
    assert caught.group_contains(Boom, depth=None)


@pytest.mark.parametrize("end", ["sender", "receiver"])
async def test_a_channel_without_a_task_group_says_how_to_give_it_one(end, tmp_path):
    with pytest.raises(RuntimeError, match="pass task_group= when making it, or use it as `async with`"):
        if end == "sender":
            await Sender(fast_config(), name="e").connect(f"ipc://{tmp_path}/ch", wait=False)
        else:
            await Receiver(fast_config(), name="e").bind(f"ipc://{tmp_path}/ch")


async def test_an_error_in_the_body_of_async_with_comes_out_as_it_is():
    with pytest.raises(KeyError):
        async with Receiver(fast_config(), name="e"), Sender(fast_config(), name="e"):
            raise KeyError("mine")


def test_a_consumer_lost_under_plain_asyncio_run_gets_its_batches_resent(tmp_path):
    """Under plain `asyncio.run` (benchmarks, user tools) a loss is noticed in a socket's callback,
    which is no task: the channel's tasks (re-send, closing the lost link's memory later) must start
    from there too."""
    async def main() -> None:
        cfg = fast_config(capacity_messages=8)
        address = f"ipc://{tmp_path}/ch"
        async with Sender(cfg, name="e") as tx:
            async with Receiver(cfg, name="e") as rx:
                await tx.connect(await rx.bind(address))
                await tx.send(batch(0))
                await wait_until(lambda: rx.statistics().received == 1)
            # closed without acknowledging p0: the sender starts a new link and re-sends p0 on it
            async with Receiver(cfg, name="e") as again:
                await again.bind(address)
                with anyio.fail_after(10):
                    assert (await again.recv()).batch_id == "p0"
                # the lost link's memory closes later (one arena per link lost: before the new consumer
                # binds, the sender may start and lose a few links on the same address)
                assert len(tx._lingering) >= 1

    asyncio.run(main())
