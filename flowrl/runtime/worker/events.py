"""The node process's event queue: what its main loop takes, one event at a time, in arrival order.

    events = Events()
    events.put(("data", port, batch, rx))   # input tasks; ("ctl", msg): the control task; ("error", e)
    event = events.take_nowait()            # None when the queue is empty
    event = await events.take()             # waits for the next one

Unbounded, like the channels' own queues behind it (credit bounds what the inputs hand over). Not
anyio's memory object stream: its `send` and `receive` each yield a turn of the event loop before
they look at the queue (a checkpoint), two turns more per batch for a node whose loop turns about
nine times a batch. Here taking a queued event is a call, and only a wait yields.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Events:
    def __init__(self) -> None:
        self._queue: deque = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, event: tuple) -> None:
        self._queue.append(event)
        self._ready.set()

    def take_nowait(self) -> tuple | None:
        return self._queue.popleft() if self._queue else None

    async def take(self) -> tuple:
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        return self._queue.popleft()
