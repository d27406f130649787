"""One round of a weight sync: members say they are free, then the publisher releases them together.

Why: a subscriber takes part only between two batches, and one batch may run for minutes. If the
collective started when the publisher did, its timeout would run while the subscriber is still
busy. So every round opens with a handshake in the (sealed) epoch store, and the collective's
timeout counts from the release, when every member is known to be waiting:

    round-R/ready/RANK   "ok" | "refused: WHY"    a subscriber, once it is between batches (or,
                                                  one that receives beside its calls, once its last
                                                  round landed: `announce_ahead`)
    round-R/go           "go" | "abort: WHY"      the publisher, once every member said ok (or
                                                  one refused, or `ready_timeout_s` passed)

Past round 0 a member only ever says ok (a refusal is said by `join`, at round 0), so the publisher
takes a ready key's presence as the answer: one store round trip per member, not two. A member
that said ready ahead, and is the publisher's only one, posts its receive without waiting for the go
(nobody else can hold the go back); a round the publisher refuses then ends that receive by shutting
the group's connections down (`WeightPublisher._close_group`), not at the collective's timeout.

Bound: choose ready_timeout_s >= the longest any member (the trainer included) may stay in one
batch: the node's process timeout. The publisher's round ends, delivered or failed with a named
error, within ready_timeout_s + 2 x timeout_s of its `serve` (ready wait, then group forming and
the broadcast); a subscriber's within 2 x ready_timeout_s + 2 x timeout_s of its `receive` (the
trainer may itself need up to ready_timeout_s to reach `serve`). A newer epoch ends the waits of
an older one within SLICE_S (`fence`): the ready wait, the wait for the go, and the forming of the
group (its store hears the fence, see `store`); only a broadcast already under way runs to its
timeout_s, or ends when the publisher leaves the epoch (an early receive is one from its start).
Every round the controller orders gets a verdict, also one the publisher refuses (a stale or
failed epoch): `go`, or `abort: WHY`, so no subscriber of that round waits for nothing.
"""

from __future__ import annotations

import time
from typing import Any

from flowrl.weights.errors import WeightSyncError
from flowrl.weights.store import FIRST_WAIT_S, Stop, blocking, wait_until

SLICE_S = FIRST_WAIT_S  # how soon a waiting member hears that its epoch was fenced (at most)


def _ready(r: int, rank: int) -> str:
    return f"round-{r}/ready/{rank}"


def _go(r: int) -> str:
    return f"round-{r}/go"


def announce(store: Any, r: int, rank: int, status: str = "ok") -> None:
    store.set(_ready(r, rank), status)


def gather(store: Any, r: int, world_size: int, ready_timeout_s: float, stop: Stop = None) -> None:
    """Publisher: wait until ranks 1..world_size-1 all said ok; raise at the first refusal, or
    naming who is late at the deadline, or at once when `stop()` gives a reason. (A rank's record
    is waited for and then read: two round trips to the store, none to check for it first.)"""
    deadline = time.monotonic() + ready_timeout_s
    pending = list(range(1, world_size))
    while pending:
        if not _wait_key(store, _ready(r, pending[0]), deadline, stop):
            late = [x for x in pending if not store.check([_ready(r, x)])]
            raise WeightSyncError(
                f"rank(s) {late} did not say they were ready within ready_timeout_s={ready_timeout_s:.1f} s: "
                "dead, or busy in a batch for longer than that (make ready_timeout_s at least the node's process "
                "timeout)")
        rank = pending.pop(0)
        if r > 0:  # past round 0 a member only says ok (join says a refusal, at round 0), and a client
            continue  # without the secret cannot name the key: it is there, that is the answer
        status = store.get(_ready(r, rank)).decode()  # StoreAuthError for a forged record
        if status != "ok":
            raise WeightSyncError(f"rank {rank} {status}")


def release(store: Any, r: int, verdict: str = "go") -> None:
    store.set(_go(r), verdict)


def forget(store: Any, r: int, world_size: int) -> None:
    """Publisher, once every member said ready for round r + 1: the keys of round r were read by
    everyone (a member announces round r + 1 only after its receive of round r returned) and can
    go. Not at the end of round r itself: a broadcast completes on the publisher while a member
    down the tree may not have read the go yet, and a key deleted under a reader's check-then-get
    blocks that get until its timeout."""
    for rank in range(1, world_size):
        store.delete_key(_ready(r, rank))
    store.delete_key(_go(r))


def await_release(store: Any, r: int, ready_timeout_s: float, stop: Stop = None) -> None:
    """Subscriber: wait for the publisher's go: it reaches `serve` within ready_timeout_s and gives
    its verdict within ready_timeout_s more. A dead publisher takes its store along: an error at once."""
    deadline = time.monotonic() + 2 * ready_timeout_s
    if not _wait_key(store, _go(r), deadline, stop):
        raise WeightSyncError(f"no go from the publisher for round {r} within 2 x ready_timeout_s = "
                              f"{2 * ready_timeout_s:.1f} s")
    said = store.get(_go(r)).decode()
    if said != "go":
        raise WeightSyncError(f"the publisher aborted round {r}: {said}")


def verdict(store: Any, r: int) -> str:
    """What the publisher said of round r, for an error: of a receive posted without waiting for the
    go, which failed (`WeightSubscriber.receive`)."""
    try:
        return f"the publisher said: {store.get(_go(r)).decode()}" if store.check([_go(r)]) else \
            "no verdict from the publisher"
    except Exception as e:  # noqa: BLE001 - the publisher's store is gone with it
        return f"no verdict from the publisher: {e}"


def _wait_key(store: Any, key: str, deadline: float, stop: Stop) -> bool:
    """Until `key` is set (True) or the deadline (False); `stop` is heard within SLICE_S."""
    return wait_until(lambda: store.check([key]), deadline, stop, block=blocking(store, [key]))
