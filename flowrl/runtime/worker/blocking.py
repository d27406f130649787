"""Blocking calls off the event loop: `await blocking.run(fn)` runs `fn()` on a helper thread and
returns its result (or raises its exception) on the loop.

    sent = await blocking.run(lambda: publisher.serve(epoch, world_size, timeout_s=30))

For what blocks in C or on a socket and must not hold the loop: a weight-sync round's collectives,
a store round trip. The node's own hooks run on its compute thread instead (compute.py).

Why not `anyio.to_thread.run_sync`: it does the same with a capacity limiter, a cancel scope, a
copy of the context and a result queue per call; on graphs/grpo.yaml, two or three hops a step per
process, that was ~0.1 ms of the loop's CPU a hop. Here a hop is a queue put, a Future, and one
`call_soon_threadsafe` back.

What must hold (as with anyio's default): a call in flight is waited for even when the caller is
cancelled (the buffers it fills belong to the caller); the cancellation comes at the caller's next
await. Calls never wait for each other: an idle thread takes a call, else a new thread does (a
publisher's round may block until a subscriber in the same process takes its own). A forked child
starts with no threads: it makes its own.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import anyio
from anyio.lowlevel import checkpoint_if_cancelled

THREAD_NAME = "flowrl-blocking"


class _Thread(threading.Thread):
    def __init__(self, idle: list) -> None:
        super().__init__(name=THREAD_NAME, daemon=True)
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = idle

    def run(self) -> None:
        while True:
            fn, loop, done = self.calls.get()
            try:
                result, error = fn(), None
            except StopIteration as e:  # a Future refuses it (it would end the awaiting coroutine)
                result, error = None, RuntimeError(f"a blocking call raised StopIteration: {e!r}")
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            self.idle.append(self)  # before the answer: the caller's next call may come to this thread
            try:
                loop.call_soon_threadsafe(_answer, done, result, error)
            except RuntimeError:  # the caller's loop is gone (the process is ending)
                pass
            del fn, result, error, done


_idle: list[_Thread] = []
_pending = 0  # calls made and not yet returned to their caller


def _forget_parent() -> None:
    """In a forked child: the parent's threads and calls are not its own."""
    global _pending
    _idle.clear()
    _pending = 0


os.register_at_fork(after_in_child=_forget_parent)


async def run(fn: Callable[[], Any]) -> Any:
    """`fn()` on a helper thread; its result here, or its exception. A caller cancelled already
    does not start it."""
    global _pending
    await checkpoint_if_cancelled()
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    try:
        thread = _idle.pop()
    except IndexError:
        thread = _Thread(_idle)
        thread.start()
    thread.calls.put((fn, loop, done))
    _pending += 1
    try:
        with anyio.CancelScope(shield=True):  # a call in flight is waited for (module docstring)
            return await done
    finally:
        _pending -= 1


def pending() -> int:
    """Calls of this process made and not yet returned to their caller (on a helper thread, or
    answered and about to resume it): a test that waits for every task to block waits for these too."""
    return _pending


def _answer(done: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not done.done():
        done.set_exception(error) if error is not None else done.set_result(result)
