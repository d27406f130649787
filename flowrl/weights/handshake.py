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
trainer may itself need up to ready_timeout_s to reach `serve`).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from flowrl.weights.errors import WeightSyncError


def _ready(r: int, rank: int) -> str:
    return f"round-{r}/ready/{rank}"


def announce(store: Any, r: int, rank: int, status: str = "ok") -> None:
    store.set(_ready(r, rank), status)


def gather(store: Any, r: int, world_size: int, ready_timeout_s: float) -> None:
    """Publisher: wait until ranks 1..world_size-1 all said ok; raise naming who refused or is late."""
    deadline = time.monotonic() + ready_timeout_s
    late = []
    for rank in range(1, world_size):
        left = deadline - time.monotonic()
        try:
            if left <= 0 or late:
                if not store.check([_ready(r, rank)]):
                    late.append(rank)
                continue
            store.wait([_ready(r, rank)], datetime.timedelta(seconds=left))
        except Exception:  # noqa: BLE001 - the store's timeout error; named below
            late.append(rank)
    refused = []
    for rank in range(1, world_size):
        if rank in late:
            continue
        status = store.get(_ready(r, rank)).decode()  # StoreAuthError for a forged record
        if status != "ok":
            refused.append(f"rank {rank} {status}")
    if refused:
        raise WeightSyncError("; ".join(refused))
    if late:
        raise WeightSyncError(
            f"rank(s) {late} did not say they were ready within ready_timeout_s={ready_timeout_s:.1f} s: dead, "
            "or busy in a batch for longer than that (make ready_timeout_s at least the node's process timeout)")


def release(store: Any, r: int, verdict: str = "go") -> None:
    store.set(f"round-{r}/go", verdict)


def forget(store: Any, r: int, world_size: int) -> None:
    """Publisher, after a delivered round: its keys are read by everyone and can go."""
    for rank in range(1, world_size):
        store.delete_key(_ready(r, rank))
    store.delete_key(f"round-{r}/go")


def await_release(store: Any, r: int, ready_timeout_s: float) -> None:
    """Subscriber: wait for the publisher's go: it reaches `serve` within ready_timeout_s and gives
    its verdict within ready_timeout_s more. A dead publisher takes its store along: an error at once."""
    try:
        store.wait([f"round-{r}/go"], datetime.timedelta(seconds=2 * ready_timeout_s))
    except Exception as e:  # noqa: BLE001
        raise WeightSyncError(f"no go from the publisher for round {r} within 2 x ready_timeout_s = {2 * ready_timeout_s:.1f} s: {e}") from e
    verdict = store.get(f"round-{r}/go").decode()
    if verdict != "go":
        raise WeightSyncError(f"the publisher aborted round {r}: {verdict}")
