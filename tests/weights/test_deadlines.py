"""Every wait of a weight sync ends: at its deadline with a named error, or at once when a newer
epoch fences it (the controller forms one whenever a member leaves). One test per wait:

    publisher  ready wait (gather)        fenced, or ready_timeout_s naming the late rank
    publisher  forming the group          fenced, or timeout_s
    publisher  an order it refuses        its subscribers still get a verdict (abort), not silence
    subscriber wait for the go            fenced (test_sync.py), or the publisher's abort
"""

from __future__ import annotations

import threading
import time

import pytest

from flowrl.weights import WeightPublisher, WeightSubscriber, WeightSyncError
from flowrl.weights.handshake import announce
from flowrl.weights.store import connect
from tests.weights.peers import master

pytestmark = pytest.mark.timeout(60)
SECRET = "s" * 32


def observer(pub: WeightPublisher, epoch: int):
    """A client of its own on the publisher's store (a TCPStore client is not shared across threads)."""
    return connect(pub.store_addr, SECRET, timeout_s=20).child(f"epoch-{epoch}")


def serve_in_thread(call) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            out["result"] = call()
        except WeightSyncError as e:
            out["error"] = str(e)
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_a_member_gone_after_its_ready_does_not_hold_the_group_forming_past_a_fence():
    """Rank 1 said ready, then left (killed, removed by scale): the publisher forms the group
    without anyone to meet. A newer epoch ends that wait within a quarter second, not timeout_s."""
    pub = WeightPublisher(lambda: master(1), secret=SECRET)
    pub.snapshot(1)
    try:
        announce(pub._store.child("epoch-1"), 0, 1)  # its last words
        t, out = serve_in_thread(lambda: pub.serve(1, 2, timeout_s=50, ready_timeout_s=50))
        observer(pub, 1).wait(["round-0/go"])  # the publisher released the round: now it forms the group
        fenced = time.monotonic()
        pub.fence(2)
        t.join(timeout=10)
        assert not t.is_alive() and time.monotonic() - fenced < 2, out
        assert "epoch 1 is stale" in out["error"], out
    finally:
        pub.close()


def test_the_group_forming_ends_at_its_timeout_naming_what_it_waited_for():
    pub = WeightPublisher(lambda: master(1), secret=SECRET)
    pub.snapshot(1)
    try:
        announce(pub._store.child("epoch-1"), 0, 1)
        with pytest.raises(WeightSyncError, match="cannot form weight group epoch 1 as rank 0/2") as err:
            pub.serve(1, 2, timeout_s=1, ready_timeout_s=5)
        assert "within 1.0 s" in str(err.value) or "within 1 s" in str(err.value), err.value
    finally:
        pub.close()


def test_a_round_the_publisher_refuses_still_gets_a_verdict_so_its_subscriber_stops_waiting():
    """The publisher was fenced to epoch 2 before it reached epoch 1's order (say, the order queued
    behind a training batch): its subscriber of epoch 1 (a replica being removed gets no epoch 2
    order to fence it) hears `abort` at once instead of waiting 2 x ready_timeout_s for a go."""
    pub = WeightPublisher(lambda: master(1), secret=SECRET)
    pub.snapshot(1)
    sub = WeightSubscriber(master(0), version=0)
    try:
        sub.join(1, 1, 2, pub.store_addr, SECRET, timeout_s=5, ready_timeout_s=50)
        t, out = serve_in_thread(sub.receive)
        observer(pub, 1).wait(["round-0/ready/1"])  # the subscriber now waits for the go
        pub.fence(2)
        with pytest.raises(WeightSyncError, match="epoch 1 is stale"):
            pub.serve(1, 2, timeout_s=5, ready_timeout_s=50)
        t.join(timeout=10)
        assert not t.is_alive() and out["seconds"] < 5, out
        assert "aborted round 0" in out["error"] and "epoch 1 is stale" in out["error"], out
        assert sub.version == 0
    finally:
        pub.close()
        sub.close()


def test_a_failed_epoch_answers_its_next_round_with_an_abort_too():
    pub = WeightPublisher(lambda: master(1), secret=SECRET)
    pub.snapshot(1)
    try:
        with pytest.raises(WeightSyncError, match="did not say they were ready"):
            pub.serve(1, 2, timeout_s=1, ready_timeout_s=0.2)  # round 0: rank 1 never came
        with pytest.raises(WeightSyncError, match="already failed"):
            pub.serve(1, 2, timeout_s=1, ready_timeout_s=0.2)  # round 1
        store = pub._store.child("epoch-1")
        assert store.get("round-0/go").decode().startswith("abort: rank(s) [1] did not say")
        assert store.get("round-1/go").decode().startswith("abort: weight-sync epoch 1 already failed")
    finally:
        pub.close()


def test_waiting_long_for_a_busy_member_logs_one_store_timeout_not_four_a_second(capfd):
    """A wait blocks on the store for its first quarter second (a key set meanwhile wakes it at
    once), then polls: c10d logs a warning for every timed-out blocking wait, and slices of a
    quarter second filled a trainer's log with them for as long as a member was busy."""
    pub = WeightPublisher(lambda: master(1), secret=SECRET)
    pub.snapshot(1)
    try:
        with pytest.raises(WeightSyncError, match=r"rank\(s\) \[1\] did not say they were ready"):
            pub.serve(1, 2, timeout_s=1, ready_timeout_s=2.0)
    finally:
        pub.close()
    assert capfd.readouterr().err.count("timed out after") <= 1


def test_a_group_forming_that_no_fence_can_reach_is_left_to_its_thread_once_fenced():
    """gloo retries a member that died after posting its address for 5 x its timeout, deaf to the
    fence; the forming runs on a thread of its own and the caller leaves at its fence."""
    from flowrl.weights.group import _fenced

    forever, fenced = threading.Event(), []
    with pytest.raises(WeightSyncError, match="left while forming: epoch 3 is stale"):  # not its result, 60 s on
        _fenced(lambda: forever.wait(60), lambda: "epoch 3 is stale" if fenced else fenced.append(1))
    forever.set()
    assert _fenced(lambda: "pg", lambda: None) == "pg"  # formed: the group, as without a fence
    with pytest.raises(ValueError, match="bad"):
        _fenced(lambda: (_ for _ in ()).throw(ValueError("bad")), lambda: None)  # its error, on this thread
