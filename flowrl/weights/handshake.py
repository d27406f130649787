"""One round of a weight sync: members say they are free, then the publisher releases them together.

Why: a subscriber takes part only between two batches, and one batch may run for minutes. If the
collective started when the publisher did, its timeout would run while the subscriber is still
busy. So every round opens with a handshake in the (sealed) epoch store, and the collective's
timeout counts from the release, when every member is known to be waiting:

    round-R/ready/RANK   "ok" | "refused: WHY"    a subscriber, once it is between batches
    round-R/go           "go" | "abort: WHY"      the publisher, once every member said ok (or
                                                  one refused, or `ready_timeout_s` passed)

Bound: choose ready_timeout_s >= the longest any member (the trainer included) may stay in one
batch: the node's process timeout. The publisher's round ends, delivered or failed with a named
error, within ready_timeout_s + 2 x timeout_s of its `serve` (ready wait, then group forming and
the broadcast); a subscriber's within 2 x ready_timeout_s + 2 x timeout_s of its `receive` (the
trainer may itself need up to ready_timeout_s to reach `serve`). A newer epoch ends the waits of
an older one within SLICE_S (`fence`).
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable

from flowrl.weights.errors import WeightSyncError

Stop = Callable[[], "str | None"] | None  # a reason to stop waiting (the epoch was fenced), or None
SLICE_S = 0.25  # how soon a waiting member hears that its epoch was fenced


def _ready(r: int, rank: int) -> str:
    return f"round-{r}/ready/{rank}"


def announce(store: Any, r: int, rank: int, status: str = "ok") -> None:
    store.set(_ready(r, rank), status)


def gather(store: Any, r: int, world_size: int, ready_timeout_s: float, stop: Stop = None) -> None:
    """Publisher: wait until ranks 1..world_size-1 all said ok; raise at the first refusal, or
    naming who is late at the deadline, or at once when `stop()` gives a reason."""
    deadline = time.monotonic() + ready_timeout_s
    pending = list(range(1, world_size))
    while pending:
        for rank in [x for x in pending if store.check([_ready(r, x)])]:
            pending.remove(rank)
            status = store.get(_ready(r, rank)).decode()  # StoreAuthError for a forged record
            if status != "ok":
                raise WeightSyncError(f"rank {rank} {status}")
        if pending and time.monotonic() >= deadline:
            raise WeightSyncError(
                f"rank(s) {pending} did not say they were ready within ready_timeout_s={ready_timeout_s:.1f} s: "
                "dead, or busy in a batch for longer than that (make ready_timeout_s at least the node's process "
                "timeout)")
        if pending:
            _pause(store, _ready(r, pending[0]), deadline, stop)


def release(store: Any, r: int, verdict: str = "go") -> None:
    store.set(f"round-{r}/go", verdict)


def forget(store: Any, r: int, world_size: int) -> None:
    """Publisher, after a delivered round: its keys are read by everyone and can go."""
    for rank in range(1, world_size):
        store.delete_key(_ready(r, rank))
    store.delete_key(f"round-{r}/go")


def await_release(store: Any, r: int, ready_timeout_s: float, stop: Stop = None) -> None:
    """Subscriber: wait for the publisher's go: it reaches `serve` within ready_timeout_s and gives
    its verdict within ready_timeout_s more. A dead publisher takes its store along: an error at once."""
    key, deadline = f"round-{r}/go", time.monotonic() + 2 * ready_timeout_s
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise WeightSyncError(f"no go from the publisher for round {r} within 2 x ready_timeout_s = "
                                  f"{2 * ready_timeout_s:.1f} s")
        _pause(store, key, deadline, stop)
    verdict = store.get(key).decode()
    if verdict != "go":
        raise WeightSyncError(f"the publisher aborted round {r}: {verdict}")


def _pause(store: Any, key: str, deadline: float, stop: Stop) -> None:
    """Wait until `key` is set, at most one slice (so `stop` is heard within SLICE_S)."""
    reason = stop() if stop is not None else None
    if reason:
        raise WeightSyncError(reason)
    left = min(SLICE_S, deadline - time.monotonic())
    if left > 0:
        try:
            store.wait([key], datetime.timedelta(seconds=left))
        except Exception:  # noqa: BLE001 - a timeout; a broken store raises in the caller's next check()
            pass
