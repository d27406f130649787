"""No peer can abort a consumer: the libzmq 4.3.5 `!_io_error` assertion (a burst past the receive
high-water mark, then a disconnect, on a connection with ZeroMQ heartbeats) kills plain pyzmq, and
a flowrl Receiver, whose socket runs without ZeroMQ heartbeats, survives it and keeps serving."""

import signal
import sys
from pathlib import Path

import anyio
import pytest
import zmq

from tests.transport.helpers import spawn_peer, spawn_python

REPRO = str(Path(__file__).with_name("zmq_abort.py"))
ABORTS = zmq.zmq_version() == "4.3.5"  # the bug's version; a fixed libzmq no longer aborts


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


async def burst_against_a_blocked_consumer(tmp_path, *flags: str, producer_count: int = 0) -> tuple:
    """Run a consumer, hold its event loop while a burst arrives and its sender leaves, then ask it
    for its memory and (if alive) have a producer send `producer_count` batches through it.
    Returns (exit code, or None while alive, the consumer's batch ids)."""
    address = f"ipc://{tmp_path}/rx"
    async with spawn_peer("consumer", address, "--gated", *flags) as rx:
        await rx.next_event("ready")
        await rx.tell(cmd="block", s=2.0)
        await rx.next_event("blocking")
        async with spawn_python(REPRO, "attack", address) as attacker:
            await attacker.next_event("sent", timeout=20)  # every message written, the connection closed
        try:
            await rx.next_event("unblocked")
            await rx.tell(cmd="rss")
            await rx.next_event("rss", timeout=10)
        except Exception:  # noqa: BLE001 - its output ended: it died; the exit code says how
            with anyio.fail_after(10):
                await rx.process.wait()
            return rx.process.returncode, []
        ids = []
        if producer_count:
            async with spawn_peer("producer", address, "--count", str(producer_count)) as tx:
                await rx.tell(cmd="take", n=producer_count)
                for _ in range(producer_count):
                    ids.append((await rx.next_event("recv"))["batch_id"])
                await tx.next_event("done")
        return rx.process.returncode, ids


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_flowrl_receiver_survives_the_abort_burst_and_keeps_serving(tmp_path):
    code, ids = await burst_against_a_blocked_consumer(tmp_path, producer_count=5)
    assert code is None
    assert ids == [f"b{i}" for i in range(5)]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_same_burst_aborts_a_receiver_whose_socket_has_zeromq_heartbeats(tmp_path):
    if not ABORTS:
        pytest.skip(f"libzmq {zmq.zmq_version()} is not the 4.3.5 this abort was seen with")
    code, _ = await burst_against_a_blocked_consumer(tmp_path, "--zmq-heartbeats")
    assert code == -signal.SIGABRT
