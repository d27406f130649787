"""A subscriber that says it is ready for its next round ahead (a worker's fetch lane, once its last
round landed), in real processes over gloo: the round needs no go handshake of its own, and a round
the publisher refuses fails the receive posted ahead at once, never at the collective's timeout."""

from __future__ import annotations

from datetime import timedelta

import pytest

from flowrl.weights import WeightSyncError
from flowrl.weights.store import connect
from tests.weights.peers import expected_digest, master
from tests.weights.test_sync import publisher

pytestmark = pytest.mark.timeout(90)
TIMEOUT_S = 45  # each collective's: far longer than the tests let anyone wait, so a timeout is the bug


def said_ready(peers, pub, r: int) -> None:
    """Wait until rank 1 said it is ready for round r of epoch 1 (a client of our own: TCPStore
    clients are not shared across threads)."""
    observer = connect(pub.store_addr, peers.secret, timeout_s=10).child("epoch-1")
    observer.wait([f"round-{r}/ready/1"], timedelta(seconds=30))


def test_a_subscriber_ready_ahead_takes_every_next_version_without_waiting_for_a_go(peers):
    """Round 0 forms the group through the handshake. From round 1 the subscriber said ready before
    the round was served and, as the publisher's only member, posts its receive at once: its rounds
    wait for no go (the publisher's ready wait found the member ready), and each version arrives whole."""
    pub, weights = publisher(peers.secret)
    sub = peers.start("sub", {"addr": pub.store_addr, "ops": [
        {"op": "join", "epoch": 1, "rank": 1, "world": 2, "timeout_s": TIMEOUT_S},
        {"op": "receive"}, {"op": "ahead"}, {"op": "receive"}, {"op": "ahead"}, {"op": "receive"}]})
    try:
        assert pub.serve(1, 2, timeout_s=TIMEOUT_S, ready_timeout_s=30) == 1
        for version in (2, 3):
            said_ready(peers, pub, version - 1)  # before the round is served
            weights.update(master(version))
            pub.snapshot(version)
            assert pub.serve(1, 2, timeout_s=TIMEOUT_S, ready_timeout_s=30) == version
    finally:
        pub.close()
    ops = peers.results(sub)
    assert [o.get("received") for o in ops] == [None, 1, None, 2, None, 3]
    assert [o.get("ahead") for o in ops] == [None, None, True, None, True, None]
    assert [o["digest"] for o in ops if o.get("received")] == [expected_digest(v, "float32") for v in (1, 2, 3)]
    assert ops[-1]["go_waits"] == [0]  # only the round that formed the group waited for its go


def test_a_receive_posted_ahead_of_its_go_fails_at_once_when_the_publisher_refuses_the_round(peers):
    """A newer epoch was ordered on the publisher: it refuses the subscriber's next round of the old
    one. The subscriber, ready ahead, is already in its receive: the publisher shuts the old group's
    connections down, so the receive fails now, naming the refusal, and the weights stay as they were."""
    pub, _ = publisher(peers.secret)
    sub = peers.start("sub", {"addr": pub.store_addr, "ops": [
        {"op": "join", "epoch": 1, "rank": 1, "world": 2, "timeout_s": TIMEOUT_S},
        {"op": "receive"}, {"op": "ahead"}, {"op": "receive"}]})
    try:
        assert pub.serve(1, 2, timeout_s=TIMEOUT_S, ready_timeout_s=30) == 1
        said_ready(peers, pub, 1)
        pub.fence(2)
        with pytest.raises(WeightSyncError, match="epoch 1 is stale"):
            pub.serve(1, 2, timeout_s=TIMEOUT_S, ready_timeout_s=30)
        assert pub._group is None
        *_, refused = peers.results(sub, timeout=20)  # far below the 45 s the receive would otherwise wait
    finally:
        pub.close()
    assert "Timed out" not in refused["error"] and "abort: weight-sync epoch 1 is stale" in refused["error"], refused
    assert refused["version"] == 1 and refused["digest"] == expected_digest(1, "float32")
    assert refused["go_waits"] == [0]
