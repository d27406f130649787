"""The weight version of a node process: one writer, and the node's context always agrees with it.

    version = WeightVersion(nctx)   # nctx.policy_version == 0
    version.bump()                  # a trainer published: 1, and nctx.policy_version == 1
    version.set(7)                  # a subscriber loaded version 7 (or a trainer its checkpoint's)
    version.forget()                # a subscriber after a rollback: -1 until the restored weights come

Why one class: the version is changed by a publish, a checkpoint load, a rollback with nothing
committed, a weight sync, a rollback of a subscriber and a restart after one; the user's node reads
it as `ctx.policy_version`. Written by hand at each place, the context was updated at only some of
them. Every change goes through this object, which updates the context with it (the rule's test:
tests/runtime/test_weight_version.py).
"""

from __future__ import annotations

from typing import Any

UNKNOWN = -1  # a subscriber whose weights were rolled back: no version counts until one arrives


class WeightVersion:
    """The policy version this process holds (subscriber) or has published (trainer)."""

    def __init__(self, ctx: Any, value: int = 0):
        self._ctx = ctx  # the NodeContext the user's node sees
        self._value = value
        self._listeners: list = []
        ctx.policy_version = value

    def listen(self, fn) -> None:
        """Call `fn(value)` after every change (from the thread that made it; a service's version gate)."""
        self._listeners.append(fn)

    @property
    def value(self) -> int:
        return self._value

    def set(self, value: int) -> None:
        """This process now holds (or has published) weights of version `value`."""
        self._value = int(value)
        self._ctx.policy_version = self._value
        for fn in self._listeners:
            fn(self._value)

    def bump(self) -> int:
        """A trainer made a new version (one update after the last): returns it."""
        self.set(self._value + 1)
        return self._value

    def forget(self) -> None:
        """A subscriber's weights no longer count (a rollback): batches wait for the next sync."""
        self.set(UNKNOWN)
