"""A channel end in its own process, driven by the transport tests (never imports torch).

    python tests/transport/peer.py consumer ADDRESS [--hold-after K] [--capacity N] [--gated]
    python tests/transport/peer.py producer ADDRESS --count N [--size BYTES] [--capacity N] [--interval S]
    python tests/transport/peer.py junk ADDRESS          # a plain pyzmq DEALER: frames from stdin

It speaks JSON lines: events on stdout ({"event": "ready" | "recv" | "sent" | "done" | "rss" |
"error", ...}), commands on stdin (consumer with --gated: {"cmd": "take", "n": 3} receives three
more batches, {"cmd": "rss"} reports resident memory, {"cmd": "block"} holds its event loop (as a
long computation would) until the line {"cmd": "release"} comes, or for "max_s" seconds (60 by
default) at most, and then says {"event": "unblocked", "released": true | false}; junk:
{"frames": [hex, ...]} sends one message). Every event is flushed at once, so the test can order
its steps on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import sys
import time

import numpy as np


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def config(args):
    from flowrl.transport import ChannelConfig

    return ChannelConfig(capacity_messages=args.capacity, capacity_bytes=args.capacity_bytes,
                         heartbeat_s=0.1, peer_timeout_s=args.peer_timeout,
                         secret=bytes.fromhex(args.secret_hex) if args.secret_hex else None,
                         link_capacity_messages=args.link_messages, link_capacity_bytes=args.link_bytes,
                         max_message_bytes=args.max_message_bytes, credit_idle_s=args.credit_idle)


async def stdin_lines():
    async for cmd in Commands():
        yield cmd


class Commands:
    """The JSON commands on stdin, one a line: read from the event loop (`async for`), or while the
    loop is held (`block`)."""

    def __init__(self):
        self.reader: asyncio.StreamReader | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.reader is None:
            loop = asyncio.get_running_loop()
            self.reader = asyncio.StreamReader(limit=1 << 24)
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(self.reader), sys.stdin)
        if not (line := await self.reader.readline()):
            raise StopAsyncIteration
        return json.loads(line)

    def block(self, max_s: float) -> bool:
        """Hold the event loop (the calling thread waits in `select`, as a long computation in C
        would) until the line {"cmd": "release"} comes on stdin: True; or `max_s` seconds passed or
        stdin closed: False. Only called between commands, when the reader holds nothing unread
        (the test writes the release after this process said "blocking")."""
        fd = sys.stdin.fileno()  # non-blocking (connect_read_pipe): read what select says is there
        end = time.monotonic() + max_s
        data = b""
        while b"\n" not in data:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return False
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                return False
            data += chunk
        line, rest = data.split(b"\n", 1)
        if rest:
            self.reader.feed_data(rest)  # later commands, for the loop once it runs again
        cmd = json.loads(line)
        if cmd.get("cmd") != "release":
            raise ValueError(f"a held consumer takes only {{'cmd': 'release'}}, got {cmd}")
        return True


async def consumer(args) -> None:
    import psutil

    from flowrl.transport import EndOfStream, Receiver

    if args.zmq_heartbeats:  # the consumer as it was: ZeroMQ heartbeats on its ROUTER (test_abort.py)
        from flowrl.transport import sockets

        plain_router = sockets.router

        def router(cfg):
            sock = plain_router(cfg)
            sockets._heartbeats(sock, cfg)
            return sock

        sockets.router = router
    async with Receiver(config(args), name=args.name) as rx:  # closed on the way out
        address = await rx.bind(args.address)
        emit(event="ready", address=address, rss=psutil.Process().memory_info().rss)
        received = 0
        commands = Commands() if args.gated else None
        budget = 0
        while True:
            while commands is not None and budget == 0:
                cmd = await commands.__anext__()
                if cmd["cmd"] == "rss":
                    emit(event="rss", rss=psutil.Process().memory_info().rss, stats=rx.statistics().as_dict())
                elif cmd["cmd"] == "block":  # hold the event loop, as a long computation would
                    emit(event="blocking")
                    emit(event="unblocked", released=commands.block(cmd.get("max_s", 60.0)))
                else:
                    budget += cmd["n"]
            try:
                batch = await rx.recv()
            except EndOfStream:
                emit(event="done", received=received, stats=rx.statistics().as_dict(),
                     rss=psutil.Process().memory_info().rss)
                return
            received += 1
            budget -= 1 if commands is not None else 0
            emit(event="recv", batch_id=batch.batch_id, first=int(batch.tensors["x"].reshape(-1)[0]),
                 n=received, nbytes=batch.nbytes, t=time.monotonic())
            if args.hold_after is None or received <= args.hold_after:
                await rx.ack(batch)


async def producer(args) -> None:
    from flowrl.transport import Batch, Sender

    async with Sender(config(args), name=args.name) as tx:
        await tx.connect(args.address)
        emit(event="ready")
        n = max(1, args.size // 8)
        for i in range(args.count):
            x = np.full(n, i, dtype=np.int64)
            await tx.send(Batch(tensors={"x": x}, batch_id=f"b{i}"))
            if not args.quiet:
                emit(event="sent", i=i, stats=tx.statistics().as_dict())
            if args.interval:
                await asyncio.sleep(args.interval)
        await tx.end_of_stream()
        emit(event="done", stats=tx.statistics().as_dict())


async def junk(args) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.address)
    emit(event="ready")
    async for cmd in stdin_lines():
        sock.send_multipart([bytes.fromhex(f) for f in cmd["frames"]])
        emit(event="sent")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["consumer", "producer", "junk"])
    ap.add_argument("address", nargs="?")
    ap.add_argument("--name", default="test->peer")
    ap.add_argument("--count", type=int, default=10)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--capacity", type=int, default=4)
    ap.add_argument("--capacity-bytes", type=int, default=1 << 30)
    ap.add_argument("--peer-timeout", type=float, default=2.0)
    ap.add_argument("--hold-after", type=int, default=None, help="stop acknowledging after K batches")
    ap.add_argument("--gated", action="store_true", help="receive only when told on stdin")
    ap.add_argument("--secret-hex", default=None, help="the channel secret, hex")
    ap.add_argument("--link-messages", type=int, default=None)
    ap.add_argument("--link-bytes", type=int, default=None)
    ap.add_argument("--max-message-bytes", type=int, default=1 << 30)
    ap.add_argument("--credit-idle", type=float, default=None)
    ap.add_argument("--interval", type=float, default=0.0, help="producer: seconds between sends")
    ap.add_argument("--quiet", action="store_true", help="producer: no event per batch sent")
    ap.add_argument("--zmq-heartbeats", action="store_true", help="consumer: ZeroMQ heartbeats on its socket")
    args = ap.parse_args()
    try:
        asyncio.run({"consumer": consumer, "producer": producer, "junk": junk}[args.role](args))
    except Exception as e:  # noqa: BLE001 - reported to the test, which decides
        emit(event="error", error=f"{type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    main()
