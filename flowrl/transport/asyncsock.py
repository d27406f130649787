"""`AsyncSocket`: a plain ZeroMQ socket awaited from asyncio, for the request-sized control traffic
between the controller and its node processes.

Why not zmq.asyncio: every send and receive there resolves a Future through pyzmq's generic
machinery, converting `zmq.POLLIN`/`EVENTS` enums at each step (Python's `enum` is slow), and
re-arms the socket's watch after every operation. On graphs/grpo.yaml that was ~1 ms of CPU a step
across the controller and two node processes, for a handful of small messages. Here an operation
that can go at once goes at once (one `EVENTS` read, one send or receive), and only an operation
that must wait registers the socket's FD with the event loop.

The FD is edge-triggered: it signals that `EVENTS` may have changed, and reading `EVENTS` (which
every send and receive does inside libzmq, one that fails too) can swallow that signal. So every
read of `EVENTS` here wakes each waiter whose event is there (`_events`), and every send or
receive while somebody waits reads it again after, as zmq.asyncio does. Single-threaded: use a
socket from its event loop's thread only.
"""

from __future__ import annotations

import asyncio

import zmq

_DONTWAIT = int(zmq.DONTWAIT)
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
RETRY_S = 0.001  # a send refused while the socket says it can send retries after this (never spins)


class AsyncSocket:
    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self._get = sock.get  # an int back, without the enum sugar of getsockopt
        self._fd = sock.get(int(zmq.FD))
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # the one the FD is registered with

    # operations ---------------------------------------------------------------------------------
    async def send_multipart(self, frames: list[bytes]) -> None:
        """Send every frame (waiting while the socket cannot take a message: its high-water mark).
        A ZMQError other than EAGAIN (ROUTER_MANDATORY's unroutable peer) is raised."""
        last, send = len(frames) - 1, self.sock.send
        while True:  # a send, one that fails too, reads the socket's commands (its edge): wake who waits
            try:
                for i, f in enumerate(frames):
                    send(f, _DONTWAIT | (_SNDMORE if i < last else 0))  # later parts of a message never EAGAIN
            except zmq.Again:
                events = self._events()
            except zmq.ZMQError:
                if self._waiters:
                    self._events()
                raise
            else:
                if self._waiters:
                    self._events()
                return
            if events & POLLOUT:  # a ROUTER says POLLOUT when any peer can take one: not ours
                await asyncio.sleep(RETRY_S)
            else:
                await self._wait(POLLOUT)

    async def send(self, data: bytes) -> None:
        await self.send_multipart([data])

    async def recv_multipart(self) -> list[bytes]:
        """The next message's frames, as bytes."""
        while not self._events() & POLLIN:
            await self._wait(POLLIN)
        recv, more = self.sock.recv, self._get
        frames = [recv(_DONTWAIT)]
        while more(_RCVMORE):
            frames.append(recv(_DONTWAIT))
        if self._waiters:
            self._events()
        return frames

    async def recv(self) -> bytes:
        """The next message (its first frame: the caller's messages are one frame)."""
        return (await self.recv_multipart())[0]

    async def poll(self, timeout_s: float, flag: int = POLLIN) -> bool:
        """Whether `flag` is set now, or gets set within `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._events() & flag:
            left = deadline - loop.time()
            if left <= 0:
                return False
            await self._wait(flag, left)
        return True

    def close(self, linger: int | None = None) -> None:
        """Close the socket; an operation waiting on it raises ZMQError (ENOTSOCK)."""
        self._unregister()
        self.sock.close(linger=linger)
        for _, fut in self._waiters:
            _settle(fut)

    @property
    def closed(self) -> bool:
        return self.sock.closed

    # waiting ------------------------------------------------------------------------------------
    async def _wait(self, flag: int, timeout_s: float | None = None) -> None:
        """Until `flag` may be set, or `timeout_s` passed: the caller re-reads EVENTS. The FD stays
        watched from the first wait until `close` (a watch per wait costs two syscalls)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append((flag, fut))
        if self._loop is not loop:
            self._unregister()
            self._loop = loop
            loop.add_reader(self._fd, self._wake)
        timer = loop.call_later(timeout_s, _settle, fut) if timeout_s is not None else None
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            self._waiters = [w for w in self._waiters if w[1] is not fut]

    def _wake(self) -> None:
        """The FD fired: wake every waiter whose event is set."""
        if not self.sock.closed:
            self._events()

    def _events(self) -> int:
        """The socket's EVENTS, every waiter whose event is set woken: every read of EVENTS goes
        through here, since a read can take the FD's edge that a waiter's wake-up needed."""
        events = self._get(_EVENTS)
        for flag, fut in self._waiters:
            if events & flag:
                _settle(fut)
        return events

    def _unregister(self) -> None:
        if self._loop is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            self._loop = None


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
