"""Conformance suite: every channel kind (ipc, tcp, inproc) must pass every test here.

Real-process variants of the failure cases (kill -9, flow control across processes) are in
test_processes.py; here both ends live in the test process and a crash is `Receiver.abort()`.
"""

import numpy as np
import pytest

from flowrl.transport import Batch, BrokenChannel, ChannelClosed, EndOfStream, Receiver, Sender
from tests.transport.helpers import KINDS, address_for, drain, fast_config, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


def batch(i: int, n: int = 8, producer: str = "p") -> Batch:
    return Batch(tensors={"x": np.full(n, i, dtype=np.int64)}, meta={"producer": producer, "i": i},
                 batch_id=f"{producer}{i}")


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


async def test_batches_arrive_in_order_and_intact(kind, tmp_path):
    cfg = fast_config(transport=kind)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as tx:
        await tx.connect(await rx.bind(address_for(kind, tmp_path)))
        sent = [batch(i, n=1 + 5000 * (i % 3)) for i in range(30)]  # inline and framed tensors

        async def produce():
            for b in sent:
                await tx.send(b)
            await tx.end_of_stream()

        import anyio
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            got = await drain(rx)
        assert [b.batch_id for b in got] == [b.batch_id for b in sent]
        assert all(np.array_equal(a.tensors["x"], b.tensors["x"]) for a, b in zip(got, sent))
        assert got[3].meta == {"producer": "p", "i": 3}
        st_tx, st_rx = tx.statistics(), rx.statistics()
        assert st_tx.sent == st_tx.acked == st_rx.received == st_rx.acked == 30
        assert st_tx.in_flight == 0 and st_rx.in_flight == 0 and st_rx.rejected == 0


async def test_two_producers_keep_their_order_and_nothing_is_lost_or_duplicated(kind, tmp_path):
    import anyio

    cfg = fast_config(transport=kind)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as a, Sender(cfg, name="e") as b:
        address = await rx.bind(address_for(kind, tmp_path))
        await a.connect(address)
        await b.connect(address)

        async def produce(tx, name):
            for i in range(40):
                await tx.send(batch(i, producer=name))
            await tx.end_of_stream()

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce, a, "a")
            tg.start_soon(produce, b, "b")
            got = await drain(rx)
        ids = [g.batch_id for g in got]
        assert sorted(ids) == sorted([f"a{i}" for i in range(40)] + [f"b{i}" for i in range(40)])
        for name in "ab":
            assert [int(i[1:]) for i in ids if i[0] == name] == list(range(40))


async def test_a_batch_is_held_by_its_sender_until_acknowledged(kind, tmp_path):
    cfg = fast_config(transport=kind)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as tx:
        await tx.connect(await rx.bind(address_for(kind, tmp_path)))
        await tx.send(batch(0))
        await tx.send(batch(1))
        first = await rx.recv()
        assert [b.batch_id for b in tx.unacked()] == ["p0", "p1"]
        await rx.ack(first)
        await rx.ack(first)  # idempotent
        assert rx.statistics().acked == 1
        await wait_until(lambda: [b.batch_id for b in tx.unacked()] == ["p1"])
        with pytest.raises(ValueError, match="delivery tag"):
            await rx.ack(first.select([0]))


async def test_fan_out_skips_a_replica_without_credit(kind, tmp_path):
    import anyio

    cfg = fast_config(transport=kind, capacity_messages=2)
    async with Receiver(cfg, name="e") as stuck, Receiver(cfg, name="e") as busy, Sender(cfg, name="e") as tx:
        await tx.connect(await stuck.bind(address_for(kind, tmp_path, "stuck")))
        await tx.connect(await busy.bind(address_for(kind, tmp_path, "busy")))

        async def consume():
            while True:
                await busy.ack(await busy.recv())

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for i in range(10):  # `stuck` never acknowledges: it holds at most its 2 credits
                await tx.send(batch(i))
            await wait_until(lambda: stuck.statistics().received + busy.statistics().received == 10)
            tg.cancel_scope.cancel()
        assert stuck.statistics().received <= 2
        assert busy.statistics().received >= 8


async def test_replicas_that_keep_up_take_turns(kind, tmp_path):
    # one message at a time, each acknowledged before the next: every replica is equally idle at each
    # send, and they take turns (an idle replica added by `flowrl scale` is not passed over)
    cfg = fast_config(transport=kind)
    async with Receiver(cfg, name="e") as a, Receiver(cfg, name="e") as b, Sender(cfg, name="e") as tx:
        await tx.connect(await a.bind(address_for(kind, tmp_path, "a")))
        await tx.connect(await b.bind(address_for(kind, tmp_path, "b")))
        for i in range(6):
            await tx.send(batch(i))
            await wait_until(lambda: a.statistics().received + b.statistics().received == i + 1)
            await wait_until(lambda: a.statistics().queued + b.statistics().queued == 1)
            rx = a if a.statistics().queued else b
            got = await rx.recv()
            await rx.ack(got)
            await wait_until(lambda: not tx.unacked())
        assert a.statistics().received == b.statistics().received == 3


async def test_a_slow_consumer_slows_the_producer_instead_of_growing_memory(kind, tmp_path):
    import anyio

    cfg = fast_config(transport=kind, capacity_messages=3, capacity_bytes=64 << 10)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as tx:
        await tx.connect(await rx.bind(address_for(kind, tmp_path)))
        sent = 0

        async def produce():
            nonlocal sent
            for i in range(20):
                await tx.send(batch(i, n=2048))  # 16 KiB each: bytes bind before messages
                sent += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            await wait_until(lambda: tx.statistics().credit_waits > 0)
            st = rx.statistics()
            assert st.queued_bytes <= 64 << 10 and st.in_flight <= 3
            assert sent <= 4  # 64 KiB of credit holds 3 such messages (and one may be in flight)
            for i in range(20):
                b = await rx.recv()
                assert b.batch_id == f"p{i}"
                assert rx.statistics().queued_bytes <= 64 << 10
                await rx.ack(b)
        assert tx.statistics().credit_waits >= 1


async def test_end_of_stream_comes_after_every_producer_finished(kind, tmp_path):
    cfg = fast_config(transport=kind)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as a, Sender(cfg, name="e") as b:
        address = await rx.bind(address_for(kind, tmp_path))
        await a.connect(address)
        await b.connect(address)
        await a.send(batch(0, producer="a"))
        await rx.ack(await rx.recv())
        await a.end_of_stream()
        with pytest.raises(ChannelClosed, match="end_of_stream"):
            await a.send(batch(1, producer="a"))
        await b.send(batch(0, producer="b"))
        got = await rx.recv()
        assert got.batch_id == "b0"
        await rx.ack(got)
        await b.end_of_stream()
        with pytest.raises(EndOfStream):
            await rx.recv()


async def test_closed_ends_say_so(kind, tmp_path):
    cfg = fast_config(transport=kind)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as tx:
        await tx.connect(await rx.bind(address_for(kind, tmp_path)))
        await rx.aclose()
        with pytest.raises(ChannelClosed):
            await rx.recv()
        await tx.aclose()
        with pytest.raises(ChannelClosed):
            await tx.send(batch(0))


async def test_a_restarted_consumer_gets_every_unacknowledged_batch(kind, tmp_path):
    cfg = fast_config(transport=kind, capacity_messages=8)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as tx:
        address = await rx.bind(address_for(kind, tmp_path))
        await tx.connect(address)
        for i in range(6):
            await tx.send(batch(i))
        for _ in range(2):
            await rx.ack(await rx.recv())
        await wait_until(lambda: tx.statistics().acked == 2)
        rx.abort()  # a crash: nobody is told; p2..p5 were delivered but not acknowledged
        async with Receiver(cfg, name="e") as again:
            await again.bind(address)
            await tx.send(batch(6))
            got = []
            while len(got) < 5:
                b = await again.recv()
                got.append(b.batch_id)
                await again.ack(b)
            assert got == ["p2", "p3", "p4", "p5", "p6"]
            # p6 may have gone to the dead consumer before its loss was noticed: then it is re-sent too
            assert tx.statistics().resent in (4, 5) and tx.statistics().peers_lost == 1
            await wait_until(lambda: not tx.unacked())


async def test_a_batch_in_flight_holds_only_itself_and_a_resend_prepares_it_whole_again(kind, tmp_path):
    """A written batch keeps no header or buffers of its own (held for every batch in flight, the
    garbage collector walked them at each young-generation pass); re-sent, it is prepared again."""
    cfg = fast_config(transport=kind, capacity_messages=8)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as tx:
        address = await rx.bind(address_for(kind, tmp_path))
        await tx.connect(address)
        sent = [batch(i, n=1 + 5000 * (i % 2)) for i in range(4)]  # inline and framed tensors
        for b in sent:
            await tx.send(b)
        await wait_until(lambda: rx.statistics().received == 4)
        in_flight = [e for link in tx._links.values() for e in link.unacked.values()]
        assert len(in_flight) == 4 and all(e.prepared is None for e in in_flight)
        assert tx.unacked() == sent
        rx.abort()  # a crash: all four go again, to the restart
        async with Receiver(cfg, name="e") as again:
            await again.bind(address)
            got = []
            while len(got) < 4:
                got.append(await again.recv())
                await again.ack(got[-1])
            assert [b.batch_id for b in got] == [b.batch_id for b in sent]
            assert all(np.array_equal(a.tensors["x"], b.tensors["x"]) and a.meta == b.meta for a, b in zip(got, sent))
            await wait_until(lambda: not tx.unacked())
            assert tx.statistics().resent == 4


async def test_unacknowledged_batches_come_back_when_no_consumer_returns(kind, tmp_path):
    cfg = fast_config(transport=kind, capacity_messages=8, peer_timeout_s=0.5)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as tx:
        address = await rx.bind(address_for(kind, tmp_path))
        await tx.connect(address)
        for i in range(3):
            await tx.send(batch(i))
        await wait_until(lambda: rx.statistics().received == 3)
        rx.abort()
        await wait_until(lambda: tx.statistics().peers == 0)  # the loss is noticed
        with pytest.raises(BrokenChannel):
            await tx.send(batch(3))  # waits at most peer_timeout_s for a replica; p3 stays ours
        await wait_until(lambda: tx.statistics().returned == 3)
        assert [b.batch_id for b in tx.take_returned()] == ["p0", "p1", "p2"]
        assert tx.take_returned() == [] and tx.unacked() == []


async def test_a_producer_gone_without_end_of_stream_breaks_recv(kind, tmp_path):
    cfg = fast_config(transport=kind, peer_timeout_s=0.5)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as tx:
        await tx.connect(await rx.bind(address_for(kind, tmp_path)))
        await tx.send(batch(0))
        await rx.ack(await rx.recv())
        await tx.aclose()  # closed without end_of_stream
        with pytest.raises(BrokenChannel, match="before end-of-stream"):
            await rx.recv()
        assert rx.statistics().peers_lost == 1
        async with Sender(cfg, name="e") as replacement:  # e.g. restarted by a supervisor
            await replacement.connect(rx.address)
            await replacement.send(batch(1))
            assert (await rx.recv()).batch_id == "p1"  # reported once; recv() works again


async def test_a_dead_producer_is_dropped_from_the_end_of_stream_set(kind, tmp_path):
    cfg = fast_config(transport=kind)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as ok, Sender(cfg, name="e") as gone:
        address = await rx.bind(address_for(kind, tmp_path))
        await gone.connect(address)
        await ok.connect(address)
        await gone.aclose()
        await wait_until(lambda: rx.statistics().peers_lost == 1)
        await ok.send(batch(0))
        await rx.ack(await rx.recv())
        await ok.end_of_stream()
        with pytest.raises(EndOfStream):
            await rx.recv()


async def test_a_producers_wait_ends_at_a_change_or_its_own_deadline_never_at_another_waits(kind):
    """`Sender._wait_change`, under every wait of a producer (credit, a connect, end-of-stream): a
    wait whose deadline passes wakes alone; a change wakes every wait; a cancelled wait leaves
    nothing behind."""
    import anyio

    async with Sender(fast_config(transport=kind), name="w") as tx:
        woke: list[str] = []

        async def wait(name: str, timeout: float) -> None:
            await tx._wait_change(timeout)
            woke.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, "long", 60.0)
            tg.start_soon(wait, "short", 0.01)
            await wait_until(lambda: woke == ["short"])
            for _ in range(20):  # turns of the loop in which "long" would wake if the timer had woken it
                await anyio.lowlevel.checkpoint()
            assert woke == ["short"]
            tx._notify()
        assert woke == ["short", "long"]
        with anyio.move_on_after(0.01):
            await tx._wait_change(60.0)
        assert tx._waiters == []


async def test_connect_gives_up_when_no_consumer_answers(kind, tmp_path):
    cfg = fast_config(transport=kind, peer_timeout_s=0.3)
    address = {"ipc": f"ipc://{tmp_path}/nobody", "tcp": "tcp://127.0.0.1:1", "inproc": "inproc://nobody"}[kind]
    async with Sender(cfg, name="e") as tx:
        with pytest.raises(BrokenChannel, match="no consumer"):
            await tx.connect(address)


async def test_a_batch_larger_than_the_consumer_accepts_is_refused_by_send(kind, tmp_path):
    cfg = fast_config(transport=kind, capacity_bytes=4096)
    async with Receiver(cfg, name="e") as rx, Sender(cfg, name="e") as tx:
        await tx.connect(await rx.bind(address_for(kind, tmp_path)))
        with pytest.raises(ValueError, match="split it"):
            await tx.send(batch(0, n=1024))
        await tx.send(batch(1, n=16))
        assert (await rx.recv()).batch_id == "p1"


async def test_a_replica_that_handed_its_credit_back_is_asked_for_credit_when_the_producer_passes_it_over(
        kind, tmp_path):
    # one replica keeps up (it always has credit) while the other's link handed its unused credit
    # back at a heartbeat and went idle: the next send that passes the idle one over asks it for
    # credit again, and the send after goes to it. (Before, an idle link got credit only when the
    # producer was blocked on every replica, which never happens while one keeps up: a replica
    # added by `flowrl scale` between two bursts was never sent anything.)
    cfg = fast_config(transport=kind, heartbeat_s=20.0, peer_timeout_s=60.0)  # the test hands credit back itself
    async with Receiver(cfg, name="e") as a, Receiver(cfg, name="e") as b, Sender(cfg, name="e") as tx:
        await tx.connect(await a.bind(address_for(kind, tmp_path, "a")))
        await tx.connect(at_b := await b.bind(address_for(kind, tmp_path, "b")))
        idle = tx._links[at_b]
        await wait_until(lambda: idle.avail_m > 0, what="b's first credit")
        await tx.send(batch(0))  # neither was chosen yet: a, the first
        await a.ack(await a.recv())
        await wait_until(lambda: not tx.unacked())
        idle.give_back_credit()  # what a heartbeat does to a link unused since the last one
        tx._send_hello(idle)
        await tx.send(batch(1))  # b is next in turn but has no credit: a gets it, b is asked for credit
        assert (await a.recv()).batch_id == "p1"
        await wait_until(lambda: idle.avail_m > 0, what="b to be granted credit again")
        await tx.send(batch(2))
        got = await b.recv()
        assert got.batch_id == "p2" and a.statistics().received == 2
