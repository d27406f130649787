"""No peer can abort a consumer: the libzmq 4.3.5 `!_io_error` assertion (a burst past the receive
high-water mark, then a disconnect, on a connection with ZeroMQ heartbeats) kills plain pyzmq, and
a flowrl Receiver, whose socket runs without ZeroMQ heartbeats, survives it and keeps serving."""

import contextlib
import os
import signal
import sys
from pathlib import Path

import anyio
import pytest
import zmq

from tests.transport.helpers import spawn_peer, spawn_python, wait_until

REPRO = str(Path(__file__).with_name("zmq_abort.py"))
ABORTS = zmq.zmq_version() == "4.3.5"  # the bug's version; a fixed libzmq no longer aborts
LINUX = sys.platform.startswith("linux")
linux_only = pytest.mark.skipif(not LINUX, reason="reads /proc/PID/fd and fdinfo")


def run_repro(mode: str) -> int:
    import subprocess

    return subprocess.run([sys.executable, REPRO, "repro", mode], capture_output=True, timeout=60,
                          check=False).returncode


@pytest.mark.timeout(90)
def test_plain_pyzmq_with_heartbeats_aborts_on_a_burst_then_a_disconnect_and_without_them_does_not():
    if not ABORTS:
        pytest.skip(f"libzmq {zmq.zmq_version()} is not the 4.3.5 this abort was seen with")
    assert run_repro("hb") == -signal.SIGABRT
    assert run_repro("nohb") == 0


def sockets_of(pid: int) -> tuple[set[int], set[int]]:
    """(the inodes of the sockets process `pid` has open, those that one of its epoll sets watches):
    libzmq's I/O thread polls each connection in its epoll set until it gives it up."""
    open_, polled = set(), set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                open_.add(int(target[len("socket:["):-1]))
            elif target == "anon_inode:[eventpoll]":
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:  # "tfd: 15 events: 19 data: ... ino:21cc8 ..."
                    polled |= {int(line.split("ino:")[1].split()[0], 16) for line in f if line.startswith("tfd:")}
    return open_, polled


def io_thread_saw_the_close(pid: int, before: set[int]) -> bool:
    """Whether the I/O thread of the consumer `pid` (its loop held since it had the sockets `before`)
    gave up polling the connection the burst came on: it saw the peer's close while its pipe was
    full. libzmq 4.3.5 then keeps the connection open and unpolled (`_io_error`), the state from
    which a ZeroMQ heartbeat aborts; another version may close it instead."""
    try:
        open_, polled = sockets_of(pid)
    except (FileNotFoundError, ProcessLookupError):  # it is gone: its exit code says how
        return False
    new = open_ - before
    return (bool(new) or not ABORTS) and not new & polled


@contextlib.asynccontextmanager
async def a_held_consumer_after_the_burst(tmp_path, *flags: str):
    """A consumer whose event loop is held (as a long computation would) while a burst past its
    receive high-water mark arrives and its sender closes the connection; held until the test
    sends {"cmd": "release"}, 60 s at most."""
    address = f"ipc://{tmp_path}/rx"
    async with spawn_peer("consumer", address, "--gated", *flags) as rx:
        await rx.next_event("ready")
        await rx.tell(cmd="block", max_s=60.0)
        await rx.next_event("blocking")
        before = sockets_of(rx.pid)[0] if LINUX else set()
        async with spawn_python(REPRO, "attack", address) as attacker:
            await attacker.next_event("sent", timeout=20)  # every message written, the connection closed
        yield rx, address, before


@pytest.mark.anyio
@pytest.mark.timeout(60)
@linux_only
async def test_a_flowrl_receiver_survives_the_abort_burst_and_keeps_serving(tmp_path):
    async with a_held_consumer_after_the_burst(tmp_path) as (rx, address, before):
        await wait_until(lambda: rx.process.returncode is not None or io_thread_saw_the_close(rx.pid, before),
                         timeout=20, what="the consumer's I/O thread to see the close")
        assert rx.process.returncode is None, f"the consumer died ({rx.process.returncode}) with its loop held"
        await rx.tell(cmd="release")  # from here, a socket with ZeroMQ heartbeats aborts (the next test)
        assert (await rx.next_event("unblocked"))["released"]
        await rx.tell(cmd="rss")
        await rx.next_event("rss", timeout=10)
        async with spawn_peer("producer", address, "--count", "5") as tx:
            await rx.tell(cmd="take", n=5)
            ids = [(await rx.next_event("recv"))["batch_id"] for _ in range(5)]
            await tx.next_event("done")
        assert ids == [f"b{i}" for i in range(5)]
        assert rx.process.returncode is None


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_same_burst_aborts_a_receiver_whose_socket_has_zeromq_heartbeats(tmp_path):
    if not ABORTS:
        pytest.skip(f"libzmq {zmq.zmq_version()} is not the 4.3.5 this abort was seen with")
    async with a_held_consumer_after_the_burst(tmp_path, "--zmq-heartbeats") as (rx, _, _):
        with anyio.fail_after(20):  # its loop still held: its I/O thread aborts at its next heartbeat
            await rx.process.wait()
        assert rx.process.returncode == -signal.SIGABRT
