"""Channel ends in separate processes: kill -9, restarts, and flow control across processes.

Each helper process runs `peer.py`; steps are ordered on the events it prints, and it is killed by
PID in `finally` (see `helpers.spawn_peer`). ipc and tcp only: inproc cannot cross processes.
"""

import json
import select
import subprocess
import sys

import numpy as np
import pytest

from flowrl.transport import Batch, BrokenChannel, Receiver, Sender
from tests.transport.helpers import PEER, fast_config, spawn_peer, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture(params=["ipc", "tcp"])
def address(request, tmp_path):
    if request.param == "ipc":
        return f"ipc://{tmp_path}/consumer"
    import socket

    with socket.socket() as s:  # a free port, bound again by each consumer incarnation
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def batch(i: int, n: int = 16) -> Batch:
    return Batch(tensors={"x": np.full(n, i, dtype=np.int64)}, batch_id=f"b{i}")


async def test_a_killed_consumer_process_gets_its_unacknowledged_batches_resent_to_its_restart(address):
    cfg = fast_config(capacity_messages=8, peer_timeout_s=5.0)
    async with Sender(cfg, name="test->peer") as tx:
        async with spawn_peer("consumer", address, "--capacity", "8", "--hold-after", "3") as first:
            await first.next_event("ready")
            await tx.connect(address)
            for i in range(8):
                await tx.send(batch(i))
            got_first = [(await first.next_event("recv"))["batch_id"] for _ in range(8)]
            await wait_until(lambda: tx.statistics().acked == 3)
            first.kill()  # mid-stream: b3..b7 delivered, not acknowledged
        assert got_first == [f"b{i}" for i in range(8)]
        async with spawn_peer("consumer", address, "--capacity", "8") as second:
            await second.next_event("ready")
            for i in range(8, 12):
                await tx.send(batch(i))
            await tx.end_of_stream()
            done = await second.next_event("done")
            got_second = [e["batch_id"] for e in second.events if e["event"] == "recv"]
        # every batch not acknowledged by the first incarnation reaches the second, in order, once
        assert got_second == [f"b{i}" for i in range(3, 12)]
        assert done["received"] == 9
        assert tx.statistics().resent == 5 and tx.take_returned() == []


async def test_batches_of_a_killed_consumer_that_never_returns_are_handed_back(address):
    cfg = fast_config(capacity_messages=8, peer_timeout_s=0.5)
    async with Sender(cfg, name="test->peer") as tx:
        async with spawn_peer("consumer", address, "--capacity", "8", "--hold-after", "1") as consumer:
            await consumer.next_event("ready")
            await tx.connect(address)
            for i in range(4):
                await tx.send(batch(i))
            for _ in range(4):
                await consumer.next_event("recv")
            await wait_until(lambda: tx.statistics().acked == 1)
            consumer.kill()
        await wait_until(lambda: tx.statistics().returned == 3)
        assert [b.batch_id for b in tx.take_returned()] == ["b1", "b2", "b3"]
        with pytest.raises(BrokenChannel, match="no consumer replica"):
            await tx.send(batch(4))  # does not wait forever


async def test_a_fast_producer_waits_for_a_slow_consumer_whose_memory_stays_bounded(address):
    import anyio

    mib = 1 << 20
    cfg = fast_config(capacity_messages=4, capacity_bytes=4 * mib + 4096, peer_timeout_s=5.0)
    async with spawn_peer("consumer", address, "--gated", "--capacity", "4", "--capacity-bytes",
                          str(4 * mib + 4096)) as consumer:
        await consumer.next_event("ready")
        async with Sender(cfg, name="test->peer") as tx:
            await tx.connect(address)
            count = 48  # 48 MiB through a 4 MiB window

            async def produce():
                for i in range(count):
                    await tx.send(batch(i, n=mib // 8))
                await tx.end_of_stream()

            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                await wait_until(lambda: tx.statistics().credit_waits > 0)
                assert tx.statistics().sent <= 4  # the producer waits: credit, not memory, ran out
                await consumer.tell(cmd="rss")
                base = await consumer.next_event("rss")
                for i in range(count):
                    await consumer.tell(cmd="take", n=1)
                    assert (await consumer.next_event("recv"))["batch_id"] == f"b{i}"
                    if i % 8 == 7:
                        await consumer.tell(cmd="rss")
                        now = await consumer.next_event("rss")
                        assert now["stats"]["queued_bytes"] <= 4 * mib + 4096
                        assert now["rss"] - base["rss"] < 24 * mib, "consumer memory grew with the stream"
                await consumer.tell(cmd="take", n=1)
                await consumer.next_event("done")


async def test_a_killed_producer_process_does_not_leave_recv_hanging(address):
    cfg = fast_config(peer_timeout_s=0.5)
    async with Receiver(cfg, name="test->peer") as rx:
        await rx.bind(address)
        async with spawn_peer("producer", address, "--count", "1000", "--capacity", "4") as producer:
            await producer.next_event("sent")
            got = await rx.recv()
            producer.kill()
        await rx.ack(got)
        with pytest.raises(BrokenChannel, match="connection closed"):
            while True:  # what was already received is still delivered, then the loss is reported
                await rx.ack(await rx.recv())
        assert rx.statistics().peers_lost == 1


async def test_a_sent_batch_leaves_even_if_the_sender_then_blocks_its_event_loop(address):
    proc = subprocess.Popen([sys.executable, PEER, "consumer", address], stdout=subprocess.PIPE)
    try:
        def next_event(kind: str) -> dict:  # blocking on purpose: the event loop must not run
            while True:
                ready, _, _ = select.select([proc.stdout], [], [], 20)
                assert ready, f"no {kind!r} event from the consumer within 20 s"
                event = json.loads(proc.stdout.readline())
                if event["event"] == kind:
                    return event

        next_event("ready")
        async with Sender(fast_config(peer_timeout_s=5.0), name="test->peer") as tx:
            await tx.connect(address)
            await tx.send(batch(0))
            assert next_event("recv")["batch_id"] == "b0"  # arrived while this loop was blocked
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
