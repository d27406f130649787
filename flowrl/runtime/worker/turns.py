"""A node process's turn on devices it shares with colocated nodes that take turns (`take_turns`).

    turns = TurnClient(spec, compute, node=lambda: runner.node, report=send_ctl, recorder=rec)
    async with turns.use("t-000003", index=3):      # every call into the node, load or save
        ...                                          # the devices are ours; the node is awake
    turns.arrived(msg)                               # TurnGrant / TurnYield, from the control loop
    await turns.serve()                              # the worker's task: releases when asked

The controller's `TurnBook` (controller/turns.py) grants one member of the group at a time. A
member keeps its turn until another member asks (`TurnYield`): then, once the calls in progress
ended, it calls its node's `sleep` hook (memory released, RSS measured before and after) and
reports `TurnReleased`. A member that needs its devices again asks (`TurnAsk`), waits for the grant
(with a deadline: `turn_timeout_s` of its spec) and calls its node's `wake` hook first. After
setup a member is awake and holds turn 0; it releases it as soon as its event loop runs, so the
first turn goes to whoever needs its devices first. A process outside any group is unaffected
(`use` does nothing).

Why the turn covers calls, loads and saves but not sending outputs: a rollout that waits for
credit on its output edge while holding the turn would keep the trainer at the end of that edge
from ever consuming (a deadlock); the grant waits only for calls, which end (`process_timeout_s`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from flowrl.runtime.protocol import messages as m

log = logging.getLogger("flowrl.worker")

_INDEX = re.compile(r"(\d+)$")


def ticket_index(what: str) -> int:
    """The ticket index in a batch id (`t-000003` -> 3), -1 when there is none."""
    found = _INDEX.search(what or "")
    return int(found.group(1)) if found else -1


def rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - measured where possible
        return 0


class TurnError(RuntimeError):
    """No turn within the deadline: the process fails (and is restarted) rather than wait forever."""


class TurnClient:
    """Owns this process's turn: held or not, its number, the calls that use it, a yield asked."""

    def __init__(self, group: str | None, *, proc_id: str, timeout_s: float, run: Callable[..., Awaitable[Any]],
                 node: Callable[[], Any], report: Callable[[Any], Awaitable[None]], recorder):
        self.group = group
        self._proc_id = proc_id
        self._timeout_s = timeout_s
        self._run = run  # runs a hook on the compute thread (not through `use`)
        self._node = node
        self._report = report
        self._recorder = recorder
        self.held = True  # after setup the node is awake: turn 0
        self.turn = 0
        self.asleep = False
        self._busy = 0
        self._yield_asked: int | None = None
        self._lock = anyio.Lock()
        self._asked: dict[str, Any] = {}  # the ask in flight: its `event`, and the `turn` granted
        # the releases to do (a turn number) or to say again (-turn - 1), for `serve`
        self._todo = anyio.create_memory_object_stream[int](math.inf)

    @contextlib.asynccontextmanager
    async def use(self, what: str, index: int | None = None) -> AsyncIterator[None]:
        """The devices are this process's for the block (asked for and woken first if needed)."""
        if self.group is None:
            yield
            return
        async with self._lock:
            if not self.held:
                await self._acquire(what, ticket_index(what) if index is None else index)
            self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            if self._busy == 0 and self._yield_asked is not None:
                self._todo[0].send_nowait(self._yield_asked)  # `serve` releases it (not inside a cancelled scope)

    def arrived(self, msg) -> bool:
        """A control message for the turn (True: handled; from the control loop, never blocks)."""
        if isinstance(msg, m.TurnGrant):
            if self._asked and not self._asked["event"].is_set():
                self._asked["turn"] = msg.turn
                self._asked["event"].set()
            else:  # granted to nobody waiting (the asker gave up): give it back
                self._todo[0].send_nowait(-msg.turn - 1)
            return True
        if isinstance(msg, m.TurnYield):
            granted = self._asked.get("turn") if self._asked and self._asked["event"].is_set() else None
            if (self.held and msg.turn == self.turn) or (not self.held and msg.turn == granted):
                # (granted, its asker not yet woken: the yield is for the turn it is about to take)
                self._yield_asked = msg.turn
                if self.held and self._busy == 0:
                    self._todo[0].send_nowait(msg.turn)
            elif not self.held:  # already released (the release and the order crossed): say so again
                self._todo[0].send_nowait(-msg.turn - 1)
            return True
        return False

    async def order(self, msg) -> None:
        """The handler table's entry (the control loop takes these orders first, `arrived`)."""
        self.arrived(msg)

    async def serve(self) -> None:
        """The worker's task: the turn held since setup is released at once; then every yield asked
        is done once the calls in progress ended."""
        if self.group is None:
            return
        await self.release(self.turn)
        async for turn in self._todo[1]:
            if turn < 0:  # only tell the controller again
                await self._report(m.TurnReleased(turn=-turn - 1))
            else:
                await self.release(turn)

    async def release(self, turn: int) -> None:
        async with self._lock:
            if not self.held or turn != self.turn or self._busy > 0:
                return
            before = rss_bytes()
            with self._recorder.span("sleep", turn=turn):
                await self._run(self._node().sleep)
                await self._run(release_to_os)
            after = rss_bytes()
            self.held, self.asleep, self._yield_asked = False, True, None
            released_mb = (before - after) / 2**20
            self._recorder.max("sleep_rss_released_mb", released_mb, per_node=True)
            self._recorder.count("turns_slept", 1, per_node=True)
            log.info("slept (turn %d of %s): RSS %.1f -> %.1f MB, %.1f MB released", turn, self.group,
                     before / 2**20, after / 2**20, released_mb)
            await self._report(m.TurnReleased(turn=turn))

    async def _acquire(self, what: str, index: int) -> None:
        self._asked = {"event": anyio.Event(), "turn": None}
        t0 = time.monotonic()
        await self._report(m.TurnAsk(index=index))
        with anyio.move_on_after(self._timeout_s):
            await self._asked["event"].wait()
        if not self._asked["event"].is_set():
            raise TurnError(f"{self._proc_id}: no turn on its devices for {what} within {self._timeout_s:g} s "
                            f"(take_turns group {self.group}): the other members did not release them; a "
                            "holder's call is bounded by supervision.process_timeout_s, so look for the member "
                            "that is hung (flowrl status RUN_DIR --dump)")
        self._recorder.observe("turn_wait_s", time.monotonic() - t0, per_node=True)
        self.held, self.turn = True, int(self._asked["turn"])
        if self.asleep:
            with self._recorder.span("wake", turn=self.turn):
                await self._run(self._node().wake)
            self.asleep = False

    def rebuilt(self) -> None:
        """The node was built anew (a rollback with nothing committed): it is awake."""
        self.asleep = False

    def dump(self) -> str:
        return (f"turn {self.turn} of {self.group}: held {self.held}, asleep {self.asleep}, calls {self._busy}, "
                f"yield asked {self._yield_asked}")


def release_to_os() -> None:
    """What a sleep freed goes back to the OS, not only to the allocator (glibc keeps freed heap
    pages otherwise; the RSS would not show the release)."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
