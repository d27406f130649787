"""A node process (`python -m flowrl.runtime.worker SPEC`): worker.py runs it; the files beside it
are its parts (data path, rank group, orders, state, compute thread, heartbeat, weight client)."""

from flowrl.runtime.worker.worker import main

__all__ = ["main"]
