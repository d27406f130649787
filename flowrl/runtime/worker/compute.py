"""The compute thread of a node process: where the node's own code runs, off the event loop.

    compute = ComputeThread("actor.0.1")
    out = await compute.call(node.process, batch, port)   # coroutine functions and plain ones alike
    compute.where()      # "in collective all_gather: all_gather (distributed_c10d.py:4012) <- sizes ..."
    compute.close()

Why: the worker's event loop writes frames, grants credit, sends acks, takes control orders and
answers dump requests. A node's hook that computes (a training step, a collective that waits for
another rank, a checkpoint write) must never stop that: a data-parallel leader blocked in an
all-gather on the loop's thread cannot finish sending the shard its follower needs to join that
all-gather (issue: data-parallel PPO deadlocked so).

What must hold:
- Every hook of the node (setup, process/generate/join, state_dict/load_state_dict, weight
  snapshots and loads, observe, teardown) runs on this one thread, in an asyncio loop of its own:
  torch's thread-local settings (grad mode, the current CUDA device) that one hook sets hold for
  the next, and a node's `await anyio.to_thread...` works as before.
- The worker awaits each call before it takes its next event, so the order of events is the one
  the input policies decided: weight swaps, checkpoints and rollbacks fall between two calls. A
  node with `concurrency: N` (stateless, one rank) has up to N calls in flight as tasks of this
  loop (`concurrent.py`); a weight load is then one more task, which runs whole between two of
  their awaits (`WeightsClient.land`).
- torch's intra-op threads are the plan's (`torch.set_num_threads` is per process): this thread
  is the node's one compute thread, the event loop's thread only waits in epoll meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowrl.metrics.stacks import register_compute_thread
from flowrl.metrics.threads import thread_cpu_clock
from flowrl.runtime.protocol.loops import new_event_loop

COLLECTIVE_MODULES = ("torch/distributed/", "torch\\distributed\\")


class ComputeThread:
    """One daemon thread running an asyncio loop that runs the node's hooks (see the module docstring)."""

    def __init__(self, name: str = "compute") -> None:
        self._loop = new_event_loop()  # uvloop's where installed (protocol/loops.py)
        self.running: str | None = None  # the hook in flight (read by dumps)
        self.in_compute = False  # inside a `compute` span (runner.py): the CPU sampler leaves it alone
        self.left_compute_cpu = 0.0  # this thread's CPU seconds when the last span ended
        self._thread = threading.Thread(target=self._serve, name=f"flowrl-compute-{name}", daemon=True)
        self._thread.start()
        self.cpu_s = thread_cpu_clock(self._thread.ident) or (lambda: 0.0)  # this thread's CPU seconds
        register_compute_thread(self._thread.ident, self)

    def enter_compute(self) -> float:
        """A `compute` span begins (runner.py); returns this thread's CPU seconds now."""
        self.in_compute = True
        return self.cpu_s()

    def leave_compute(self) -> float:
        """The span ends; returns this thread's CPU seconds now (the sampler starts from there)."""
        self.left_compute_cpu = self.cpu_s()
        self.in_compute = False
        return self.left_compute_cpu

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` on the compute thread (awaited there when it is a coroutine
        function) and return its result or raise its exception here (any exception: SystemExit too).
        Cancelling the caller cancels the call at its next await there, or before it starts; the
        caller returns at once, while a call blocked in C (a collective) runs on until it returns."""
        if threading.current_thread() is self._thread:  # a hook that calls back into the runtime
            out = fn(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out

        caller = asyncio.get_running_loop()
        done = caller.create_future()
        state: dict[str, Any] = {"cancelled": False, "task": None}

        def finish(result: Any = None, error: BaseException | None = None) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        def answer(result: Any = None, error: BaseException | None = None) -> None:
            self.running = None
            try:
                caller.call_soon_threadsafe(finish, result, error)
            except RuntimeError:  # the caller's loop is gone (the process is ending)
                pass

        async def wrapped(aw) -> None:  # every outcome of an async hook goes back, BaseException too
            try:
                result = await aw
            except asyncio.CancelledError:
                answer(None, asyncio.CancelledError())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                answer(None, e)
            else:
                answer(result)

        def start() -> None:  # on the compute thread: a plain function answers at once, a coroutine as a task
            if state["cancelled"]:
                return
            self.running = getattr(fn, "__qualname__", repr(fn))
            try:
                out = fn(*args, **kwargs)
                if inspect.isawaitable(out):
                    state["task"] = self._loop.create_task(wrapped(out))
                    return
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                answer(None, e)
                return
            answer(out)

        def cancel() -> None:
            state["cancelled"] = True
            if state["task"] is not None:
                state["task"].cancel()

        self._loop.call_soon_threadsafe(start)
        try:
            return await done
        except asyncio.CancelledError:
            with contextlib.suppress(RuntimeError):  # a closed compute loop runs nothing any more
                self._loop.call_soon_threadsafe(cancel)
            raise

    def stack(self) -> list[traceback.FrameSummary]:
        """The compute thread's Python stack now, outermost first (empty when it is idle, or when the
        call in flight awaits something: then `running` names it)."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        if frame is None:
            return []
        frames = traceback.extract_stack(frame)
        if frames and Path(frames[-1].filename).name == "selectors.py":  # its own loop's select: nothing runs
            return []
        return frames

    def where(self, depth: int = 8) -> str:
        """What the compute thread runs, innermost first; a collective of torch.distributed is named
        ("in collective all_gather: ..."), since a rank stuck there waits for another rank."""
        frames = self.stack()
        if not frames:
            return f"awaiting in {self.running}" if self.running else "idle"
        shown = " <- ".join(f"{f.name} ({Path(f.filename).name}:{f.lineno})" for f in reversed(frames[-depth:]))
        collective = next((f.name for f in reversed(frames)
                           if any(m in f.filename for m in COLLECTIVE_MODULES) and not f.name.startswith("_")), None)
        return f"in collective {collective}: {shown}" if collective else shown

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread's loop once the call in progress (if any) returns; waits `timeout` at most
        (a call stuck in C keeps the daemon thread until the process exits)."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
