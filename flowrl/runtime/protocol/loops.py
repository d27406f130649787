"""The event loop every runtime process runs (the controller, each node process's loop and its
compute thread's): uvloop where it is installed (a core dependency on Linux and macOS), else
asyncio's own. `FLOWRL_UVLOOP=0` in the environment turns it off; node processes inherit the
controller's environment, so one setting covers a run.

    anyio.run(main, backend_options=run_options())
    loop = new_event_loop()          # a thread's own loop (runtime/worker/compute.py)

Why: a flowrl process's loop does a little work per message, many times a step (control
messages, channel reads, thread hand-offs, timers); with uvloop the loop's own part of it (epoll,
callbacks, timers, cross-thread wake-ups) runs in C. On graphs/grpo.yaml (2-core VM) the
framework's share of a step's CPU went from 11.5% to 11.2% (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

ENV = "FLOWRL_UVLOOP"


def _uvloop() -> Any:
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def run_options() -> dict[str, Any]:
    """`anyio.run`'s backend options."""
    return {"use_uvloop": True} if _uvloop() is not None else {}


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh loop of the kind `run_options` picks."""
    uvloop = _uvloop()
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
