"""`AsyncSocket` (flowrl/transport/asyncsock.py): a plain ZeroMQ socket awaited from asyncio, on
real sockets, on asyncio's loop and on uvloop.

What must hold: a receive waits for a message that comes later and gets every message in order; a
socket that sends while a receive waits does not strand that receive (a send can swallow the FD's
edge); a send waits at the high-water mark and loses nothing; `poll` times out and says so; a
ROUTER_MANDATORY send to nobody fails at once; `close` ends a pending wait.
"""

from __future__ import annotations

import contextlib

import anyio
import pytest
import zmq

from flowrl.transport.asyncsock import POLLOUT, AsyncSocket
from tests.loop_backends import anyio_backend  # noqa: F401 - asyncio's loop and uvloop

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]


@pytest.fixture
def pair(tmp_path):
    """(router, dealer) AsyncSockets over ipc, the dealer identified as b"d"."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(f"ipc://{tmp_path}/s")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"d")
    dealer.connect(f"ipc://{tmp_path}/s")
    r, d = AsyncSocket(router), AsyncSocket(dealer)
    yield r, d
    r.close(linger=0)
    d.close(linger=0)
    ctx.term()


@contextlib.contextmanager
def inproc(name: str):
    """(ROUTER with ROUTER_MANDATORY, DEALER identified as b"d"), raw, over inproc: a send is in the
    peer's pipe, and its FD signalled, when the call returns, so a test orders events exactly."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(f"inproc://{name}")
    dealer.setsockopt(zmq.IDENTITY, b"d")
    dealer.connect(f"inproc://{name}")
    try:
        yield router, dealer
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


@contextlib.asynccontextmanager
async def waiting_to_receive(sock: AsyncSocket, got: list):
    """A task waits in `sock.recv_multipart` (its FD watched) while the block runs; the block's end
    waits (10 s at most) for that receive, which appends what it got to `got`."""
    async def receive():
        got.append(await sock.recv_multipart())

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(receive)
                while not sock._waiters:
                    await anyio.sleep(0)
                yield
    finally:
        sock.close(linger=0)


async def test_a_receive_waits_for_messages_sent_later_and_gets_them_all_in_order(pair):
    router, dealer = pair
    got = []

    async def receive():
        for _ in range(200):
            got.append(await router.recv_multipart())

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            await anyio.sleep(0)  # the receive is waiting before anything is sent
            for i in range(200):
                await dealer.send(b"m%d" % i)
                if i % 7 == 0:
                    await anyio.sleep(0)
    assert got == [[b"d", b"m%d" % i] for i in range(200)]


async def test_sending_while_a_receive_waits_on_the_same_socket_never_strands_it(pair):
    """Request/reply both ways on one socket per side, a sender task and a receiver task each: the
    sends read EVENTS inside libzmq, which can swallow the edge the waiting receive needs."""
    router, dealer = pair
    n = 2000
    echoed, replies = [], []

    async def echo():
        for _ in range(n):
            ident, data = await router.recv_multipart()
            await router.send_multipart([ident, data])
            echoed.append(data)

    async def dealer_receive():
        for _ in range(n):
            replies.append(await dealer.recv())

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(echo)
            tg.start_soon(dealer_receive)
            for i in range(n):
                await dealer.send(b"%d" % i)
                if i % 3 == 0:
                    await anyio.sleep(0)
    assert replies == [b"%d" % i for i in range(n)] == echoed


async def test_a_look_at_the_socket_while_a_receive_waits_never_strands_it():
    """Reading EVENTS takes the FD's signal: whoever reads it must wake the receive it was for.
    inproc delivers synchronously, so the order here is exact."""
    got = []
    with inproc("look") as (router, dealer):
        d = AsyncSocket(dealer)
        async with waiting_to_receive(d, got):
            router.send_multipart([b"d", b"x"])  # in the dealer's pipe now, its FD signalled
            assert await d.poll(0)  # reads EVENTS: the FD's signal is gone
    assert got == [[b"x"]]


async def test_a_send_that_fails_while_a_receive_waits_never_strands_it():
    """A ROUTER_MANDATORY send to a peer not (or no longer) connected fails, as the controller's
    sends to a restarting node do every tick; inside libzmq it read the socket's commands first,
    which takes the FD's edge. Here the edge is taken by a raw read of EVENTS, then the send fails:
    the waiting receive must still get the message that came."""
    got = []
    with inproc("fails") as (router, dealer):
        r = AsyncSocket(router)
        async with waiting_to_receive(r, got):
            dealer.send(b"ready")  # inproc: in the router's pipe now, its FD signalled
            router.get(zmq.EVENTS)  # ... and the edge taken, as a failing send takes it
            with pytest.raises(zmq.ZMQError):
                await r.send_multipart([b"restarting", b"x"])
    assert got == [[b"d", b"ready"]]


async def test_a_send_at_the_high_water_mark_waits_and_loses_nothing(tmp_path):
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.RCVHWM, 1)
    router.bind(f"ipc://{tmp_path}/s")
    dealer.setsockopt(zmq.SNDHWM, 1)
    dealer.connect(f"ipc://{tmp_path}/s")
    waits = []

    class Counting(AsyncSocket):
        async def _wait(self, flag, timeout_s=None):
            waits.append(flag)
            await super()._wait(flag, timeout_s)

    r, d = AsyncSocket(router), Counting(dealer)
    n, payload = 300, b"x" * 100_000
    got = []
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                async def send_all():
                    for i in range(n):
                        await d.send(b"%d:" % i + payload)

                tg.start_soon(send_all)
                while not waits:  # the sender met the high-water mark: it waits, it did not fail
                    await anyio.sleep(0.001)
                for _ in range(n):
                    got.append((await r.recv_multipart())[1].split(b":")[0])
    finally:
        r.close(linger=0)
        d.close(linger=0)
        ctx.term()
    assert POLLOUT in waits
    assert got == [b"%d" % i for i in range(n)]


async def test_poll_says_whether_a_message_waits_or_comes_within_the_timeout(pair):
    router, dealer = pair
    assert await router.poll(0.05) is False
    await dealer.send(b"x")
    with anyio.fail_after(10):
        assert await router.poll(5.0) is True
        assert await router.poll(0.0) is True  # still there: poll does not take it
        assert await router.recv_multipart() == [b"d", b"x"]
    assert await router.poll(0.01) is False


async def test_an_unroutable_send_fails_at_once(pair):
    router, _ = pair
    with anyio.fail_after(10), pytest.raises(zmq.ZMQError) as e:
        await router.send_multipart([b"nobody", b"x"])
    assert e.value.errno == zmq.EHOSTUNREACH


async def test_close_ends_a_pending_receive_with_an_error(pair):
    router, _ = pair
    failed = []

    async def receive():
        with pytest.raises(zmq.ZMQError) as e:
            await router.recv_multipart()
        failed.append(e.value.errno)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            while not router._waiters:  # the receive waits
                await anyio.sleep(0)
            router.close(linger=0)
    assert failed == [zmq.ENOTSOCK] and router.closed
