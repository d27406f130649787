"""Plain (blocking) environment and tool code, run off an agent's loop in a thread of its own.

    out = await in_thread(env.step, text)

Its own thread, not a pool's: an environment or a tool that hangs in a plain function holds its
thread until it returns, and a pool of a few threads (asyncio's default has cores + 4) would then
make every other episode's environment and tools wait behind it, past their deadlines. The thread
is a daemon, so one that never returns does not keep the process from exiting. Cancelling the
caller (a deadline) returns at once; the thread finishes in the background.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone (the process is ending)
            pass

    threading.Thread(target=run, name=f"flowrl-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await done
