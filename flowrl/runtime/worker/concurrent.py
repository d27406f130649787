"""Several calls of one node at once: a stateless node with `concurrency: N` (a rollout whose engine
batches continuously across tickets).

    calls = Concurrent(limit=8)
    calls.bind(spawn=task_group.start_soon, fail=report_to_the_event_loop)
    await calls.start(path.run_stateless, item)   # returns at once; the call runs as its own task

Why: a continuous engine serves several tickets in one batch, so the worker must hand it the next
ticket while the last one still generates. Each call is a task of the worker's task group; its
hook runs on the node's compute thread, where the calls' coroutines interleave on its asyncio loop.

What must hold:
- The event loop never waits for a free slot: an item beyond the limit waits here (its input
  credit is not returned until its call ends, so producers stop once the credit is used), and
  control orders -- a weight sync that lands between two engine iterations, a recovery epoch --
  are taken while calls run.
- Every item passed the input policies before it got here (fence, version gate, once); its call
  acks it and follows its step (`DataPath.run_stateless`).
- A call that raises ends the process as a failing call always did: the error goes to the event
  loop, which raises it (the controller restarts the node and re-issues the open tickets).
- A recovery epoch drops the items that wait here (their tickets are issued again); calls already
  running finish, and what they send carries their old epoch, which every consumer's fence drops.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any


class Concurrent:
    """Owns the calls in flight and the items waiting for a slot."""

    def __init__(self, limit: int):
        self.limit = limit
        self.running: dict[int, Any] = {}  # id(item) -> item
        self.waiting: deque = deque()  # (fn, item) beyond the limit
        self._spawn: Callable[..., Any] | None = None
        self._fail: Callable[[BaseException], None] | None = None

    def bind(self, spawn: Callable[..., Any], fail: Callable[[BaseException], None]) -> None:
        """`spawn(fn, *args)` starts a task; `fail(error)` hands a call's error to the event loop."""
        self._spawn, self._fail = spawn, fail

    async def start(self, fn: Callable[[Any], Awaitable[None]], item: Any) -> None:
        if len(self.running) >= self.limit:
            self.waiting.append((fn, item))
            return
        self.running[id(item)] = item
        self._spawn(self._call, fn, item)

    async def _call(self, fn: Callable[[Any], Awaitable[None]], item: Any) -> None:
        try:
            await fn(item)
        except Exception as e:  # noqa: BLE001 - the event loop raises it, as for a call it awaited
            self._fail(e)
            return
        finally:
            self.running.pop(id(item), None)
        if self.waiting:
            await self.start(*self.waiting.popleft())

    def drop_waiting(self) -> list:
        """A recovery: the items that had no slot yet (their tickets are issued again)."""
        out = [item for _, item in self.waiting]
        self.waiting.clear()
        return out

    def dump(self) -> str:
        ids = [getattr(i, "batch_id", "?") for i in self.running.values()]
        return f"calls in flight ({len(ids)}/{self.limit}): {ids[:8]}; waiting for a slot: {len(self.waiting)}"
