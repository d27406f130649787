"""Producer links that end while their consumer runs on, and consumers that restart under them.

A consumer knows which producer links are alive by their routing ids, not by file descriptors.

A connection's "disconnected" event (the receiver's monitor socket) and the messages that came
through that connection (its data socket) reach the receiver on two sockets, in no fixed order, and
the closed connection's descriptor number goes to the next connection. Each test below makes one
order happen for sure: it writes with a raw DEALER (a producer link that says hello), waits without
yielding until both sockets hold what it needs, and hands them to the receiver in the order under
test. The receiver's own loop then runs; every wait has a deadline.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import zmq

from flowrl.transport import Batch, Receiver, Sender, wire
from tests.transport.helpers import deliver_to_holding_peer, drain, fast_config, spawn_peer, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def raw_link(address: str, rid: bytes) -> zmq.Socket:
    """A producer link as bare ZeroMQ: a DEALER with its own routing id, connected, said hello."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, rid)
    sock.connect(address)
    sock.send(wire.Hello(ch="raw").to_bytes())
    return sock


def wait_readable(sock: zmq.Socket, what: str, timeout_s: float = 10.0) -> None:
    """Block (the event loop too, on purpose) until `sock` has a message; nothing is read."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if not poller.poll(timeout_s * 1000):
        raise AssertionError(f"{what}: nothing arrived in {timeout_s}s")


def statuses(sock: zmq.Socket, timeout_s: float = 10.0) -> list[wire.Status]:
    """Every status the consumer sent to a raw link so far (at least one)."""
    wait_readable(sock, "a status", timeout_s)
    out = []
    while True:
        try:
            frame = sock.recv(zmq.DONTWAIT)
        except zmq.Again:
            return out
        out.append(wire.Status.from_header(wire.unpack_header(frame, wire.DecodeLimits())))


async def finish_one_batch(rx: Receiver, address: str) -> list[str]:
    """A real producer sends one batch and ends its stream; what `rx.recv()` hands out until
    EndOfStream (which it must raise: no other link may be left open)."""
    async with Sender(fast_config(), name="real") as tx:
        await tx.connect(address)
        await tx.send(Batch(tensors={"x": np.arange(4)}, batch_id="b0"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(tx.end_of_stream)
            got = await drain(rx, timeout=20)
    return [b.batch_id for b in got]


async def test_a_hello_handled_after_its_connection_closed_leaves_no_link_open(tmp_path):
    """The hello of a link whose connection has closed is handled after the "disconnected" event
    (a socket closed with linger that had reconnected to a restarted consumer does this): the link
    must still end, or recv() waits for its end-of-stream forever."""
    address = f"ipc://{tmp_path}/rx"
    async with Receiver(fast_config(), name="rx") as rx:
        await rx.bind(address)
        dead = raw_link(address, b"dead-link")
        dead.close(linger=5000)  # the hello goes out, then the connection closes
        wait_readable(rx._mon.sock, "the monitor's disconnected event")
        wait_readable(rx._pump.sock, "the dead link's hello")
        rx._mon._readable()  # the event first ...
        rx._pump._readable()  # ... then the hello
        assert await finish_one_batch(rx, address) == ["b0"]
        # the dead link ended for its connection, once (not for sitting on credit, credit_idle_s later)
        assert (rx.statistics().peers_lost, rx.statistics().reclaimed) == (1, 0)


async def test_a_hello_of_a_link_that_knew_an_earlier_incarnation_makes_no_link(tmp_path):
    """A producer socket that reconnected on its own to a consumer restarted at the same address
    still holds hellos of its old link, naming the incarnation it knew: the consumer answers "start
    a new link" and holds no link for it (one saying "eos" would otherwise count as finished)."""
    address = f"ipc://{tmp_path}/rx"
    async with Receiver(fast_config(), name="rx") as rx:
        await rx.bind(address)
        stale = zmq.Context.instance().socket(zmq.DEALER)
        stale.setsockopt(zmq.ROUTING_ID, b"stale-link")
        stale.connect(address)
        try:
            for state in ("open", "eos"):
                stale.send(wire.Hello(ch="raw", state=state, inc="an-earlier-one").to_bytes())
            got = await anyio.to_thread.run_sync(statuses, stale)  # answers to unknown links are rate-limited
            assert got and not any(st.known for st in got)
            assert rx.statistics().peers == 0
        finally:
            stale.close(linger=0)
        assert await finish_one_batch(rx, address) == ["b0"]
        assert rx.statistics().peers_lost == 0


async def test_a_link_is_not_dropped_for_an_earlier_connection_closing(tmp_path):
    """A link that connected after an earlier one closed (likely with the same descriptor number)
    is handled before the earlier connection's "disconnected" event: the event must not end it."""
    address = f"ipc://{tmp_path}/rx"
    async with Receiver(fast_config(), name="rx") as rx:
        await rx.bind(address)
        first = raw_link(address, b"first-link")
        await anyio.to_thread.run_sync(statuses, first)  # known (the receiver's loop answered)
        first.close(linger=0)
        wait_readable(rx._mon.sock, "the monitor's disconnected event of the first link")
        second = raw_link(address, b"second-link")
        wait_readable(rx._pump.sock, "the second link's hello")
        rx._pump._readable()  # the second link's hello first ...
        rx._mon._readable()  # ... then the first link's event
        try:
            for _ in range(3):  # heartbeats go by; the receiver must still know the second link
                second.send(wire.Hello(ch="raw").to_bytes())
                got = await anyio.to_thread.run_sync(statuses, second)
                assert all(st.known for st in got), "the receiver gave up on a live link"
        finally:
            second.close(linger=0)
        assert rx.statistics().peers_lost == 1  # the first link only


async def test_a_consumer_restarted_while_its_producer_ends_the_stream_gets_every_batch_and_the_end(tmp_path):
    """kill -9 of the consumer while end_of_stream() waits for its acknowledgements: the link that
    replaces the lost one re-sends what was not acknowledged, so it must not say "eos" (a consumer
    gives a finished link no credit) until nothing is left to send."""
    address = f"ipc://{tmp_path}/consumer"
    cfg = fast_config(capacity_messages=8, peer_timeout_s=5.0)
    sent = [Batch(tensors={"x": np.arange(16) + i}, batch_id=f"b{i}") for i in range(6)]
    async with Sender(cfg, name="test->peer") as tx:
        async with anyio.create_task_group() as tg:
            async with spawn_peer("consumer", address, "--capacity", "8", "--hold-after", "2") as first:
                await deliver_to_holding_peer(first, tx, address, sent, acked=2)
                tg.start_soon(tx.end_of_stream)  # waits: b2..b5 are not acknowledged
                await wait_until(lambda: tx._state == "eos")
                first.kill()
                await wait_until(lambda: tx.statistics().peers_lost == 1)
            async with Receiver(cfg, name="test->peer") as second:
                await second.bind(address)  # the restart, at the same address
                got = await drain(second, timeout=20)
                await wait_until(lambda: not tx.unacked())
        assert [b.batch_id for b in got] == ["b2", "b3", "b4", "b5"]
        assert tx.statistics().resent == 4 and tx.take_returned() == []
