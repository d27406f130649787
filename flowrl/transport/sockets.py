"""ZeroMQ sockets as channels use them: one process-wide context, options set in one place, and
`Pump`, which connects a socket to the asyncio event loop.

Every send is non-blocking (a DEALER with no connection would otherwise block forever) and no
high-water mark drops anything: credit, not ZeroMQ, bounds what is queued.

No peer can abort this process. libzmq 4.3.5 aborts (`Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)`) when a connection that has ZeroMQ heartbeats on reaches its
receive high-water mark and the peer then disconnects: a burst of RCVHWM messages and a close is
enough (tests/transport/test_abort.py reproduces it with plain pyzmq). So the consumer's ROUTER,
whose input comes from anyone who can connect, runs without ZeroMQ heartbeats (a dead producer is
noticed by its connection closing, a vanished host by TCP keepalive and TCP_MAXRT (`_common`), a
silent link by the receiver's own deadlines); a producer's DEALER keeps them (they notice a frozen
consumer host) because its receive queue is unlimited, so it never reaches the state that aborts.

Why `Pump` and not a zmq.asyncio socket: it does what zmq.asyncio does (watch the socket's FD with
`loop.add_reader`, and after each send re-check `EVENTS`, because a send may swallow the FD's
edge), but it drains all queued messages into one synchronous callback instead of resolving one
Future per message — a third of the per-message cost for small batches.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Callable

import zmq

from flowrl.transport import wire
from flowrl.transport.config import ChannelConfig

CONTROL_MAX_BYTES = 1 << 20  # statuses and hellos are small; a producer refuses bigger ones
OUTBOX_HWM = 1000  # statuses queued towards one link at most (a link that never reads costs no more)
DRAIN_MAX = 256  # messages handed to a callback at once; then the loop gets a turn
DRAIN_BYTES = 1 << 20  # ... or this many bytes: big batches are handled while still in the CPU cache


def shared_context() -> zmq.Context:
    """The process-wide context (inproc endpoints only meet inside one context)."""
    return zmq.Context.instance()


def _common(sock: Any, config: ChannelConfig) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop at a high-water mark: credit bounds the queue
    # a vanished host (no FIN, no RST) is noticed by the kernel, not by a libzmq timer: keepalive
    # probes a connection with nothing in flight; with data in flight, which towards a vanished
    # producer there nearly always is (its consumer writes it a status every heartbeat), the kernel
    # would retransmit for ~15 minutes, and TCP_MAXRT (TCP_USER_TIMEOUT on Linux) ends it instead
    idle, interval = _keepalive_s(config)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, interval)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
    sock.setsockopt(zmq.TCP_MAXRT, vanished_ms(config))


KEEPALIVE_PROBES = 3


def _keepalive_s(config: ChannelConfig) -> tuple[int, int]:
    """TCP keepalive's (idle, interval), in the whole seconds the kernel counts."""
    return max(1, int(config.peer_timeout_s)), max(1, int(config.heartbeat_s))


def vanished_ms(config: ChannelConfig) -> int:
    """How long a tcp connection to a host that stopped answering lives on, with or without data in
    flight: keepalive's bound (idle, then its probes), in milliseconds."""
    idle, interval = _keepalive_s(config)
    return 1000 * (idle + KEEPALIVE_PROBES * interval)


def _heartbeats(sock: Any, config: ChannelConfig) -> None:
    """ZeroMQ-level heartbeats: only on sockets whose receive queue is unlimited (module docstring)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(config.heartbeat_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(config.peer_timeout_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(6_553_500, max(100, int(config.peer_timeout_s * 1000))))


def router(config: ChannelConfig) -> Any:
    """The consumer's socket: bound, one pipe per producer link, addressed by routing id."""
    sock = shared_context().socket(zmq.ROUTER)
    _common(sock, config)  # no ZeroMQ heartbeats here: see the module docstring
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown routing id is an error, not a silent drop
    sock.setsockopt(zmq.RCVHWM, max(1000, 4 * config.capacity_messages))  # back-pressure, no drops
    sock.setsockopt(zmq.SNDHWM, OUTBOX_HWM)  # statuses to a link that does not read are dropped here
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes())  # a bigger frame is cut off at its length
    return sock


def dealer(config: ChannelConfig, routing_id: bytes) -> Any:
    """A producer link's socket: connected to one consumer replica."""
    sock = shared_context().socket(zmq.DEALER)
    _common(sock, config)
    _heartbeats(sock, config)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    return sock


def monitor(sock: Any, events: int) -> Any:
    return sock.get_monitor_socket(events)


def close(sock: Any, mon: Any = None, linger_ms: int = 0) -> None:
    """Close a socket and its monitor (monitor first disabled: closing a monitored socket with a
    live monitor stream can stall the context's reaper and with it every later close)."""
    if mon is not None:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        mon.close(linger=0)
    sock.close(linger=linger_ms)


class Pump:
    """Feeds every message arriving on `sock` to `handler(list_of_messages)` from the event loop,
    and sends without blocking. Single-threaded: use it only from the loop's thread.

    Sends are corked after the first: the first message of a turn of the event loop is written at
    once (so a sender that then computes without yielding still gets it out), the ones after it are
    written back-to-back when the turn ends (or once CORK_MESSAGES wait). Each write to an idle
    ZeroMQ pipe wakes its I/O thread, which costs tens of microseconds of system time; a burst wakes
    it once.
    """

    def __init__(self, sock: Any, handler: Callable[[list], None], copy: bool = False, bundle: bool = False):
        self.sock, self.handler, self.copy = sock, handler, copy
        self.bundle = bundle  # write the one-frame messages of a burst as bundles (wire.py)
        self.bundle_max = BUNDLE_BYTES  # ... of at most this many bytes (what the peer accepts)
        self.loop = asyncio.get_running_loop()
        self.fd = sock.getsockopt(zmq.FD)
        self._events = sock.get  # get(_EVENTS): an int, without the enum sugar of getsockopt
        self.closed = False
        self.on_send_error: Callable[[zmq.ZMQError, list], None] | None = None
        self._out: list[list] = []
        self._scheduled = False
        self._wrote_this_turn = False
        self.loop.add_reader(self.fd, self._readable)
        self._schedule()  # messages may have queued before the reader was registered

    def send(self, frames: list) -> None:
        """Write a message: at once if it is the first of this turn of the loop, else when the turn
        ends (or once CORK_MESSAGES wait). Frames of at least COPY_MIN bytes are sent zero-copy
        (ZeroMQ keeps a reference until written). A failed write (zmq.Again: no connection can take
        it) drops that message and calls `on_send_error(error, frames)`."""
        if self.closed:
            return
        out = self._out
        out.append(frames)
        if not self._wrote_this_turn or len(out) >= CORK_MESSAGES:
            self._wrote_this_turn = True
            self.flush()
        if not self._scheduled:
            self._schedule()

    def flush(self) -> None:
        out, self._out = self._out, []
        if self.bundle and len(out) > 1:
            out = bundled(out, self.bundle_max)
        send = self.sock.send
        for frames in out:
            if self.closed:  # an error handler closed us meanwhile
                return
            try:
                last = len(frames) - 1
                bundle = type(frames) is Bundle
                for i, f in enumerate(frames):
                    n = len(f) if type(f) is bytes else f.nbytes
                    send(f, _DONTWAIT | (_SNDMORE if i < last else 0), copy=bundle or n < COPY_MIN)
            except zmq.ZMQError as e:
                if self.on_send_error is not None:
                    self.on_send_error(e, frames)

    def out_clear(self) -> None:
        """Forget what is corked and not yet written (its link is gone)."""
        self._out.clear()

    def close(self, linger_ms: int = 0, monitor: "Pump | None" = None) -> None:
        """Write what is queued, stop reading, close the socket (and its monitor's pump)."""
        if self.closed:
            return
        if self._out:
            self.flush()
        self.closed = True
        self.loop.remove_reader(self.fd)
        if monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            monitor.close()
        self.sock.close(linger=linger_ms)

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._turn_end)

    def _turn_end(self) -> None:
        self._scheduled = self._wrote_this_turn = False
        if self.closed:
            return
        if self._out:
            self.flush()
        self._readable()  # a send can swallow the FD's edge: look for input too

    def _readable(self) -> None:
        """Hand every queued message (up to DRAIN_MAX / DRAIN_BYTES) to the handler. Whether one
        waits at all is read from the socket's EVENTS first: most looks find none (every turn that
        sent looks, `_turn_end`), and a receive that finds none raises zmq.Again, whose making (an
        error string, an import) costs more than the receive. After the first message EVENTS is
        asked once more: most drains are that one message, and end there without an Again. Past
        it, a receive per message and the one Again at the end cost less than asking EVENTS after
        each message of a burst."""
        if self.closed:
            return
        if not self._events(_EVENTS) & _POLLIN:
            return
        msgs = []
        size, full = 0, False
        try:
            if self.copy:
                recv_multipart, events = self.sock.recv_multipart, self._events
                while not full:
                    msg = recv_multipart(_DONTWAIT, copy=True)
                    msgs.append(msg)
                    for f in msg:
                        size += len(f)
                    full = len(msgs) == DRAIN_MAX or size >= DRAIN_BYTES
                    if len(msgs) == 1 and not events(_EVENTS) & _POLLIN:
                        break  # the usual drain, one message: done without the Again
            else:
                recv, events = self.sock.recv, self._events
                while not full:
                    # recv_multipart asks the socket for RCVMORE after every frame (an enum conversion
                    # each time); a received Frame already knows whether more follow
                    frame = recv(_DONTWAIT, copy=False)
                    msg = [frame]
                    size += len(frame)
                    while frame.more:
                        frame = recv(_DONTWAIT, copy=False)
                        msg.append(frame)
                        size += len(frame)
                    msgs.append(msg)
                    full = len(msgs) == DRAIN_MAX or size >= DRAIN_BYTES
                    if len(msgs) == 1 and not events(_EVENTS) & _POLLIN:
                        break  # the usual drain, one message: done without the Again
        except zmq.Again:
            pass
        if full:
            self._schedule()  # more may be queued; let other callbacks run first
        if msgs:
            self.handler(msgs)


def bundled(messages: list[list], max_bytes: int | None = None) -> list[list]:
    """`messages` with runs of one-frame messages (of at most BUNDLE_PART_BYTES) joined into
    bundles of at most `max_bytes` (wire.py); order is kept, other messages go alone."""
    max_bytes = (max_bytes or BUNDLE_BYTES) - BUNDLE_HEADER_ALLOWANCE  # its own header travels too
    out: list[list] = []
    run: list[bytes] = []
    size = 0
    for msg in messages:
        n = len(msg[0]) if len(msg) == 1 and type(msg[0]) is bytes else 0
        if run and (not n or n > BUNDLE_PART_BYTES or size + n > max_bytes):
            out.append(_bundle(run))
            run, size = [], 0
        if n and n <= BUNDLE_PART_BYTES:
            run.append(msg[0])
            size += n
        else:
            out.append(msg)
    if run:
        out.append(_bundle(run))
    return out


class Bundle(list):
    """The frames of a bundle. Written with a copy whatever their size: a zero-copy frame is released
    through pyzmq's garbage-collector thread, which then competes for the GIL, and a bundle is at
    most BUNDLE_BYTES of bytes made for this write anyway."""


def _bundle(parts: list[bytes]) -> list:
    return parts if len(parts) == 1 else Bundle([wire.pack_bundle([len(p) for p in parts]), b"".join(parts)])


_DONTWAIT = int(zmq.DONTWAIT)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_SNDMORE = int(zmq.SNDMORE)
COPY_MIN = 1 << 16  # below this, copying is cheaper than ZeroMQ's zero-copy bookkeeping
CORK_MESSAGES = 64
BUNDLE_PART_BYTES = 1 << 16  # bigger messages are not bundled: their cost is in the bytes, not the call
BUNDLE_BYTES = 1 << 19
BUNDLE_HEADER_ALLOWANCE = 4096  # bytes of a bundle's header (its part lengths), at most


async def tick_loop(heartbeat_s: float, tick, name: str, running=lambda: True) -> None:
    """Call `tick(now, stalled)` every heartbeat while `running()`. `stalled` says our own event
    loop was blocked (a long compute): missed peer messages are then not the peers' fault."""
    import logging
    import time

    last = time.monotonic()
    while running():
        await asyncio.sleep(heartbeat_s)
        now = time.monotonic()
        stalled, last = now - last > 2 * heartbeat_s, now
        try:
            tick(now, stalled)
        except Exception:  # noqa: BLE001 - heartbeats must go on; the bug is logged
            logging.getLogger("flowrl.transport").exception("channel %s: heartbeat failed", name)

