"""`sockets.Pump` reading a real socket: every message reaches the handler, in order, and a look or
a drain of one message makes no `zmq.Again` (making one costs more than the receive)."""

from __future__ import annotations

import anyio
import pytest
import zmq

from flowrl.transport.sockets import Pump

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Counting:
    """A socket that counts the zmq.Again its receives raise (the rest is the real socket's)."""

    def __init__(self, sock):
        self.sock, self.agains = sock, 0

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def recv(self, *a, **k):
        return self._counted(self.sock.recv, a, k)

    def recv_multipart(self, *a, **k):
        return self._counted(self.sock.recv_multipart, a, k)

    def _counted(self, receive, a, k):
        try:
            return receive(*a, **k)
        except zmq.Again:
            self.agains += 1
            raise


@pytest.mark.parametrize("copy", [False, True], ids=["frames", "bytes"])
async def test_every_message_arrives_in_order_and_a_lone_one_makes_no_again(copy):
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://pump")
    b.connect("inproc://pump")
    got, drains = [], []
    arrived = anyio.Event()

    def handler(msgs):
        drains.append(len(msgs))
        got.extend(bytes(m[0]) for m in msgs)
        if len(got) >= want:
            arrived.set()

    sock = Counting(b)
    pump = Pump(sock, handler, copy=copy)
    try:
        with anyio.fail_after(20):
            for i in range(20):  # one at a time: each is a drain of one
                want, arrived = i + 1, anyio.Event()
                a.send(b"%d" % i)
                await arrived.wait()
            assert sock.agains == 0 and drains == [1] * 20
            want, arrived = 120, anyio.Event()
            for i in range(20, 120):  # a burst: drained together, ended by one Again each at most
                a.send(b"%d" % i)
            await arrived.wait()
    finally:
        pump.close()
        a.close(linger=0)
        ctx.term()
    assert got == [b"%d" % i for i in range(120)]
    assert sock.agains <= len(drains) - 20
