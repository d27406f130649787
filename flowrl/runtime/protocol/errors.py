"""Errors that cross a program boundary: raised by a launcher, judged by the controller."""

from __future__ import annotations

from flowrl.errors import FlowrlError


class RunFailed(FlowrlError):
    """The run could not reach its configured end; the message says which node and why."""
