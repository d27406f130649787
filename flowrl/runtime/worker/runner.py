"""The node of a node process and every call into it: on the compute thread (one at a time, or up
to the node's `concurrency` together on its asyncio loop), with what the heartbeat reports (`busy`:
the oldest call in progress and since when).

    runner = NodeRunner(compute, faults, recorder, make=lambda: cls(config, nctx))
    await runner.build()                                    # the node as right after setup
    out = await runner.call("t-000003", runner.node.process, batch, "in")
    with runner.occupied("weight sync v4"): ...             # a long wait that is not a node call

Why here: a call past `process_timeout_s` is a hung node; the heartbeat thread (`heartbeat.py`)
reads `busy` to tell, so every path that keeps the node busy marks it through this one object.
For the same reason every call, load and save takes the process's turn on shared devices here
(`turns`, a `TurnClient` of turns.py, for colocated nodes that take turns; waiting for the turn is
not busy: it has its own deadline).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from flowrl.runtime.worker.compute import ComputeThread
from flowrl.runtime.worker.faults import FaultInjector


class NodeRunner:
    """Owns the node instance, its call count and what it is busy with."""

    def __init__(self, compute: ComputeThread, faults: FaultInjector, recorder, make: Callable[[], Any]):
        self._compute = compute
        self._faults = faults
        self._recorder = recorder
        self._make = make  # builds a fresh node (the class with its config and context)
        self._node = None
        self._busy: dict[int, tuple[str, float]] = {}  # what keeps the node busy, by mark (several calls at once)
        self._marks = 0
        self._in_calls = 0  # calls in the node now; the `compute` span runs while there is one
        self._since = (0.0, 0.0, 0.0)  # (wall, perf counter, compute thread CPU) when the first of them began
        self._calls = 0  # calls into the node so far: the step that faults count
        self._failed_on: str | None = None
        self.turns = None  # a TurnClient: every call into the node holds the process's turn (turns.py)

    @property
    def node(self):
        return self._node

    @property
    def busy(self) -> tuple[str, float] | None:
        """(what, since when) of the oldest call or long wait in progress (a node with `concurrency`
        has several); None when idle. Read by the heartbeat thread."""
        marks = list(self._busy.values())  # a copy: the loop's thread may change the dict meanwhile
        return min(marks, key=lambda m: m[1]) if marks else None

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def failed_on(self) -> str | None:
        """The batch id of the call that raised (named on the last-error line)."""
        return self._failed_on

    def turn(self, what: str) -> contextlib.AbstractAsyncContextManager:
        """The devices for `what` (nothing to wait for outside a take-turns group)."""
        return self.turns.use(what) if self.turns is not None else contextlib.nullcontext()

    async def build(self) -> None:
        """The node as right after setup (at start, and on a rollback with nothing committed)."""
        async with self.turn("setup"):
            self._node = await self._compute.call(self._make)
            await self._compute.call(self._node.setup)
            if self.turns is not None:
                self.turns.rebuilt()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runtime work that touches the node's state (a checkpoint, a snapshot): on the compute thread."""
        async with self.turn(getattr(fn, "__name__", "state")):
            return await self._compute.call(fn, *args)

    @contextlib.contextmanager
    def occupied(self, what: str) -> Iterator[None]:
        """Mark the node busy with `what` until the block ends (`busy` reports the oldest mark, so an
        outer call's mark wins over the ones inside it)."""
        self._marks += 1
        mark = self._marks
        self._busy[mark] = (what, time.monotonic())
        try:
            yield
        finally:
            del self._busy[mark]

    @contextlib.contextmanager
    def _computing(self, batch_id: str) -> Iterator[None]:
        """The `compute` span: while at least one call is in the node (calls that overlap, with
        `concurrency`, make one span, so the busy ratio says how much of the time the node works)."""
        if self._in_calls == 0:
            self._since = (time.time(), time.perf_counter(), self._compute.enter_compute())
        self._in_calls += 1
        try:
            yield
        finally:
            self._in_calls -= 1
            if self._in_calls == 0:
                self._recorder.add_span("compute", self._since[0], time.perf_counter() - self._since[1],
                                        cpu_s=self._compute.leave_compute() - self._since[2], batch_id=batch_id)

    async def serve(self, request_id: str, hook: Callable[..., Any], *args: Any) -> Any:
        """A service request into the node (`serve`): busy and `compute` like a call, no batch faults."""
        async with self.turn(request_id):
            with self.occupied(f"request {request_id}"), self._computing(request_id):
                return await self._compute.call(hook, *args)

    async def call(self, batch_id: str, hook: Callable[..., Any], *args: Any) -> Any:
        """One call into the node, on its compute thread, with its faults and its `compute` span."""
        async with self.turn(batch_id):
            return await self._call(batch_id, hook, *args)

    async def _call(self, batch_id: str, hook: Callable[..., Any], *args: Any) -> Any:
        with self.occupied(batch_id):
            try:
                await self._faults.on_batch(self._calls)
                self._calls += 1
                stall = self._faults.stall(self._calls - 1)
                if stall:  # a wedged call: the compute thread is stuck, the loop and heartbeats go on
                    await self._compute.call(time.sleep, stall)
                with self._computing(batch_id):
                    return await self._compute.call(hook, *args)
            except BaseException:
                self._failed_on = batch_id
                raise
