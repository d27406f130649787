"""What a node process waits on, written into its log on SIGUSR1 (`flowrl status RUN_DIR --dump`,
or `kill -USR1 PID`): every task's stack, every channel's counters, the input policies' queues."""

from __future__ import annotations

import time
from pathlib import Path


def await_chain(coro) -> str:
    """Where a coroutine waits: each coroutine it awaits, innermost last, then what that one awaits."""
    steps = []
    for _ in range(64):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        steps.append(f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})")
        nxt = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
        if nxt is None or not (hasattr(nxt, "cr_frame") or hasattr(nxt, "gi_frame") or hasattr(nxt, "ag_frame")):
            if nxt is not None:
                steps.append(f"waits on {type(nxt).__name__}")
            break
        coro = nxt
    return " -> ".join(steps) or repr(coro)


def task_lines() -> list[str]:
    """Each task of the running event loop and where it waits."""
    import asyncio

    return [f"task {task.get_name()}: {await_chain(task.get_coro())}" for task in asyncio.all_tasks()]


def state_dump(worker) -> str:
    """The dump of one node process (`Worker.dump_state`)."""
    parts, busy = worker.parts, worker.busy
    busy = f"{busy[0]} for {time.monotonic() - busy[1]:.1f}s" if busy else "no"
    lines = [f"state dump of {worker.spec.proc_id} (incarnation {worker.spec.incarnation}): epoch "
             f"{parts.orders.epoch}, version {parts.version.value}, step {parts.runner.calls}, busy {busy}, "
             f"stopping {worker.stopping}", f"  compute thread: {worker.compute.where()}", f"  {parts.turns.dump()}"]
    waiting = parts.ranks.waiting() if parts.ranks is not None else None
    if waiting is not None:
        lines.append(f"  accepted, waiting for the leader's verdict: {waiting}")
    lines += [f"  {line}" for line in parts.path.dump()]
    inputs = [*worker.receivers.values(), *([worker.rank_rx] if worker.rank_rx else [])]
    to_ranks = parts.ranks.senders() if parts.ranks is not None else []
    lines += [f"  channel {ch.statistics()}" for ch in [*inputs, *parts.outputs.channels(), *to_ranks]]
    lines += [f"  {line}" for line in task_lines()]
    return "\n".join(lines) + "\n"
