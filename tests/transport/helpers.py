"""Helpers of the transport tests: channel kinds and configs, waiting, helper processes.

Helper processes run `peer.py` (a channel end in its own process); they are killed by PID in
`finally`, and every wait on them has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream

from flowrl.transport import ChannelConfig

PEER = str(Path(__file__).with_name("peer.py"))
KINDS = ["ipc", "tcp", "inproc"]


def fast_config(**kw) -> ChannelConfig:
    """Short heartbeats and timeouts so that failure paths finish in about a second."""
    defaults = dict(heartbeat_s=0.1, peer_timeout_s=1.0, capacity_messages=4)
    defaults.update(kw)
    return ChannelConfig(**defaults)


def address_for(kind: str, tmp_path: Path, name: str = "ch") -> str | None:
    """A fixed address to bind (ipc inside the test's own folder), or None: let bind choose."""
    return f"ipc://{tmp_path}/{name}" if kind == "ipc" else None


async def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` until true (event ordering without sleeps in the test logic)."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


async def drain(rx, ack: bool = True, timeout: float | None = None) -> list:
    """Every batch `rx` hands out until EndOfStream (each acknowledged unless `ack` is False),
    within `timeout` seconds when one is given."""
    from flowrl.transport import EndOfStream

    out = []
    with anyio.fail_after(timeout):
        while True:
            try:
                b = await rx.recv()
            except EndOfStream:
                return out
            out.append(b)
            if ack:
                await rx.ack(b)


async def deliver_to_holding_peer(peer: "Peer", tx, address: str, batches: list, acked: int) -> list[dict]:
    """Connect `tx` to a `peer.py consumer --hold-after ACKED` and send it `batches`; returns its
    "recv" events once each arrived and the first `acked` were acknowledged (the rest it holds)."""
    await peer.next_event("ready")
    await tx.connect(address)
    for b in batches:
        await tx.send(b)
    events = [await peer.next_event("recv") for _ in batches]
    await wait_until(lambda: tx.statistics().acked == acked)
    return events


class Peer:
    """A running peer.py process: read its JSON events, write it commands, kill it."""

    def __init__(self, process):
        self.process = process
        self.pid = process.pid
        self._out = BufferedByteReceiveStream(process.stdout)
        self.events: list[dict] = []

    async def next_event(self, kind: str | None = None, timeout: float = 20.0) -> dict:
        with anyio.fail_after(timeout):
            while True:
                line = await self._out.receive_until(b"\n", 1 << 20)
                event = json.loads(line)
                self.events.append(event)
                if event["event"] == "error":
                    raise AssertionError(f"peer {self.pid} failed: {event['error']}")
                if kind is None or event["event"] == kind:
                    return event

    async def tell(self, **cmd) -> None:
        await self.process.stdin.send((json.dumps(cmd) + "\n").encode())

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def spawn_peer(*args: str) -> "contextlib.AbstractAsyncContextManager[Peer]":
    return spawn_python(PEER, *args)


@contextlib.asynccontextmanager
async def spawn_python(*args: str) -> AsyncIterator[Peer]:
    """A Python process (`python *args`) spoken to as a `Peer`; killed (by its PID) on exit."""
    process = await anyio.open_process([sys.executable, *args], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=None)
    peer = Peer(process)
    try:
        yield peer
    finally:
        peer.kill()
        with anyio.move_on_after(10):
            await process.wait()
        await process.aclose()
