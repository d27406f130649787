"""A node process (`python -m flowrl.runtime.worker SPEC`): worker.py runs it, startup.py builds
its components (the files beside it: version, runner, data path, outputs, orders, state, syncs,
rank group, group steps, compute thread, heartbeat, weight client)."""

from flowrl.runtime.worker.worker import main

__all__ = ["main"]
