"""The background work of one channel end (heartbeats, the acknowledgement timer, re-sends, closing
lingering shared memory): a task group of its own, nested in a task group its owner gives it.

    async with anyio.create_task_group() as tg:          # the owner's (a node process has one)
        tx = Sender(config, name="reward.in", task_group=tg)
        await tx.connect(address)                        # starts the channel's own group inside tg
        ...
        await tx.aclose()                                # cancels its tasks and waits for them

    async with Sender(config, name="reward.in") as tx:   # or: the channel opens (and ends) a group itself
        ...

What must hold: after `aclose()` (or `abort()` and then `aclose()`) returns, nothing of the
channel runs, and a task that fails does not die alone: the error ends the channel's group and
then the owner's, as any failed task of that group would (trio's nursery rule). Heartbeats and
re-sends keep their deliberate exceptions (a failed heartbeat is logged, not fatal).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import anyio
from anyio.abc import TaskGroup, TaskStatus


class ChannelTasks:
    """Runs a channel's background tasks; see the module docstring. `what` names the channel in errors."""

    def __init__(self, what: str, task_group: TaskGroup | None):
        self.what = what
        self.owner = task_group  # the group we run in: given, or opened by `enter()`
        self._own: Any = None  # the group `enter()` opened (the channel used as `async with`)
        self._group: TaskGroup | None = None  # ours, inside the owner's; None before start / after it ended
        self._ended: anyio.Event | None = None
        self._running = False  # our host task has begun (a task cancelled before its first step runs nothing)
        self._queued: list[tuple[Callable[..., Awaitable[Any]], tuple]] = []  # to start (see spawn)
        self._wake = asyncio.Event()
        self.cancelled = False

    async def enter(self) -> None:
        """`async with` on a channel that was given no task group: open one for it."""
        if self.owner is None:
            self._own = anyio.create_task_group()
            await self._own.__aenter__()
            self.owner = self._own

    async def exit(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool | None:
        """Leave the group `enter()` opened (after the channel was closed). An error of the body
        propagates as it is, not wrapped in an ExceptionGroup; a failed task of ours (which is
        what cancelled the body) propagates as the group's ExceptionGroup."""
        own, self._own = self._own, None
        if own is None:
            return None
        if exc is not None and not isinstance(exc, anyio.get_cancelled_exc_class()):
            await own.__aexit__(None, None, None)
            return None
        return await own.__aexit__(exc_type, exc, tb)

    async def start(self) -> None:
        """Open our group inside the owner's (once; no-op afterwards)."""
        if self._ended is not None:
            return
        if self.owner is None:
            raise RuntimeError(f"{self.what} has no task group for its background work (heartbeats, timers, "
                               f"re-sends); pass task_group= when making it, or use it as `async with`")
        self._ended = anyio.Event()
        try:
            await self.owner.start(self._host, name=f"flowrl channel {self.what}")
        except BaseException:
            if not self._running:
                self._ended = None
            raise

    async def _host(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        self._running = True
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                if self.cancelled:  # abort() came first
                    group.cancel_scope.cancel()
                task_status.started()
                while True:  # the group lives until aclose(); tasks come and go in it
                    await self._wake.wait()
                    self._wake.clear()
                    queued, self._queued = self._queued, []
                    for fn, args in queued:
                        group.start_soon(fn, *args, name=f"flowrl channel {self.what}: {fn.__name__}")
        finally:
            self._group, self._running = None, False
            self._ended.set()

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Start `fn(*args)` in our group, soon: callable from any code on the event loop, a
        socket's callback included (which is no task: anyio starts tasks from tasks, so ours
        does). False when the group is not running (not started yet, cancelled, or ended by a
        failed task)."""
        if self._group is None or self.cancelled:
            return False
        self._queued.append((fn, args))
        self._wake.set()
        return True

    def cancel(self) -> None:
        """Cancel every task of ours (without waiting: `abort()` is synchronous)."""
        self.cancelled = True
        if self._group is not None:
            self._group.cancel_scope.cancel()

    async def aclose(self) -> None:
        """Cancel every task of ours and wait until they have all ended, even when called from a
        cancelled scope (they end at their next await)."""
        self.cancel()
        if self._running:
            with anyio.CancelScope(shield=True):
                await self._ended.wait()


class TaskOwner:
    """`async with` for a channel end that holds its `ChannelTasks` as `_work`: enter opens its own
    task group (when none was given), exit closes the channel and then ends the group."""

    _work: ChannelTasks

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self):
        await self._work.enter()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        try:
            await self.aclose()
        except BaseException as e:
            await self._work.exit(type(e), e, e.__traceback__)
            raise
        return await self._work.exit(*exc)
