"""Publisher and subscribers in real processes over gloo: whole versions, named failures, no hangs."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import psutil
import pytest

from flowrl.weights import WeightPublisher, WeightSubscriber, WeightSyncError
from flowrl.weights.store import connect
from tests.weights.peers import SHAPES, expected_digest, master

pytestmark = pytest.mark.timeout(90)
SMALL = 32 << 10  # 32 KiB buckets: the test model spans several


def publisher(secret: str, version: int = 1, **kw) -> tuple[WeightPublisher, dict]:
    weights = master(version)
    pub = WeightPublisher(lambda: weights, bucket_bytes=SMALL, secret=secret, **kw)
    pub.snapshot(version)
    return pub, weights


def test_two_subscribers_receive_every_version_bitwise_in_the_serving_dtype(peers):
    """fp32 master weights served as bf16: a bf16 nn.Module (swap) and a loader subscriber."""
    pub, weights = publisher(peers.secret, serving_dtype="bfloat16")
    ops = [{"op": "join", "epoch": 1, "rank": 0, "world": 3}, {"op": "receive"}, {"op": "receive"}]
    subs = [peers.start("sub", {"addr": pub.store_addr, "dtype": "bfloat16", "bucket_bytes": SMALL, "module": True,
                                "ops": [dict(op, rank=1) if op["op"] == "join" else op for op in ops]}),
            peers.start("sub", {"addr": pub.store_addr, "loader": True,
                                "ops": [dict(op, rank=2) if op["op"] == "join" else op for op in ops]})]
    try:
        assert pub.serve(1, 3, timeout_s=20, ready_timeout_s=30) == 1
        listening = [c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"]
        weights.update(master(2))
        pub.snapshot(2)
        assert pub.serve(1, 3, timeout_s=20, ready_timeout_s=30) == 2
        # a round's keys go once every member said ready for the next (all have read them): a long run
        # does not grow the store, and no reader down the broadcast tree loses its go to a delete
        epoch = pub._store.child("epoch-1")
        assert not any(epoch.check([k]) for k in ("round-0/go", "round-0/ready/1", "round-0/ready/2"))
        assert epoch.check(["round-1/go"])
    finally:
        pub.close()
    live, loader = (peers.results(p) for p in subs)
    assert [r.get("received") for r in live] == [None, 1, 2]
    assert [r["digest"] for r in live[1:]] == [expected_digest(1, "bfloat16"), expected_digest(2, "bfloat16")]
    assert [r["module_digest"] for r in live[1:]] == [r["digest"] for r in live[1:]]  # the module uses them
    assert [r["digest"] for r in loader[1:3]] == [expected_digest(1, "bfloat16"), expected_digest(2, "bfloat16")]
    calls = loader[-1]["calls"]
    assert [c["version"] for c in calls] == [1, 2]
    assert all(sorted(c["names"]) == sorted([*SHAPES, "step"]) for c in calls)  # every tensor once per version
    # the store and gloo's sockets of the publisher listen on loopback only
    loopback = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}  # an IPv6 socket bound to IPv4 loopback reads ::ffff:127.0.0.1
    assert listening and set(listening) <= loopback, listening


def test_an_all_bf16_graph_syncs_without_a_serving_dtype(peers):
    weights = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in master(1).items()}
    pub = WeightPublisher(lambda: weights, bucket_bytes=SMALL, secret=peers.secret)
    pub.snapshot(1)
    sub = peers.start("sub", {"addr": pub.store_addr, "dtype": "bfloat16",
                              "ops": [{"op": "join", "epoch": 1, "rank": 1, "world": 2}, {"op": "receive"}]})
    try:
        assert pub.serve(1, 2, timeout_s=20, ready_timeout_s=30) == 1
    finally:
        pub.close()
    assert peers.results(sub)[-1]["digest"] == expected_digest(1, "bfloat16") == pub.digest()


def test_a_round_returns_and_digests_the_version_it_sent_though_the_next_snapshot_follows_at_once(peers, monkeypatch):
    """The trainer goes on while a round ends: a snapshot taken the moment the broadcast lets go of the
    buckets does not relabel what the round sent, and the sent version's digest is still known."""
    import flowrl.weights.publisher as publisher_module

    pub, weights = publisher(peers.secret)
    pub.keep_digests()
    sub = peers.start("sub", {"addr": pub.store_addr, "ops": [
        {"op": "join", "epoch": 1, "rank": 1, "world": 2}, {"op": "receive"}, {"op": "receive"}]})
    forget = publisher_module.forget

    def snapshot_then_forget(*args):  # runs after the broadcast of round 1, before serve returns
        weights.update(master(3))
        pub.snapshot(3)
        forget(*args)

    try:
        assert pub.serve(1, 2, timeout_s=20, ready_timeout_s=30) == 1
        weights.update(master(2))
        pub.snapshot(2)
        monkeypatch.setattr(publisher_module, "forget", snapshot_then_forget)
        assert pub.serve(1, 2, timeout_s=20, ready_timeout_s=30) == 2  # it sent 2; the buckets hold 3
    finally:
        pub.close()
    got = peers.results(sub)
    assert [r.get("received") for r in got] == [None, 1, 2]
    assert got[-1]["digest"] == pub.digest(2) == expected_digest(2, "float32")
    assert pub.digest() == pub.digest(3) == expected_digest(3, "float32") and pub.digest(1) == expected_digest(1, "float32")
    with pytest.raises(WeightSyncError, match="no digest of version 7"):
        pub.digest(7)
    for v in [*range(4, 12), 2]:  # a rollback takes version 2 again: its digest is kept though 11 is higher
        weights.update(master(v))
        pub.snapshot(v)
    assert pub.digest(2) == expected_digest(2, "float32") and pub.digest(5) == expected_digest(5, "float32")
    with pytest.raises(WeightSyncError, match="no digest of version 4"):  # the oldest of 9 went
        pub.digest(4)


@pytest.mark.parametrize("mode", ["swap", "copy"])
def test_a_broadcast_that_breaks_after_bucket_k_leaves_the_previous_version_then_a_new_epoch_delivers(peers, mode):
    pub, weights = publisher(peers.secret)
    sub = peers.start("sub", {"addr": pub.store_addr, "module": mode == "swap", "ops": [
        {"op": "join", "epoch": 1, "rank": 1, "world": 2}, {"op": "receive"},
        {"op": "receive", "fault_after": 1},  # buckets 0 and 1 of version 2 arrived, then it breaks
        {"op": "join", "epoch": 2, "rank": 1, "world": 2}, {"op": "receive"}]})
    try:
        assert pub.serve(1, 2, timeout_s=20, ready_timeout_s=30) == 1
        weights.update(master(2))
        pub.snapshot(2)
        try:
            pub.serve(1, 2, timeout_s=5, ready_timeout_s=30)
        except WeightSyncError:
            pass  # gloo may or may not notice the receiver's failure: the bytes were already sent
        assert pub.serve(2, 2, timeout_s=20, ready_timeout_s=30) == 2
        with pytest.raises(WeightSyncError, match="stale"):
            pub.serve(1, 2, timeout_s=1, ready_timeout_s=1)
    finally:
        pub.close()
    _, first, broken, _, again = peers.results(sub)
    assert first["version"] == 1 and first["digest"] == expected_digest(1, "float32")
    assert broken["staged_new"], "the fault must hit after new bytes arrived, or it proves nothing"
    assert "injected fault" in broken["error"]
    assert broken["version"] == 1 and broken["digest"] == expected_digest(1, "float32")  # label and content agree
    assert broken.get("module_digest", broken["digest"]) == broken["digest"]
    assert again["version"] == 2 and again["digest"] == expected_digest(2, "float32")


def test_a_publisher_killed_mid_broadcast_leaves_the_subscriber_on_its_previous_version(peers):
    pub = peers.start("pub", {"rounds": [{"epoch": 1, "world": 2, "version": 1},
                                         {"epoch": 1, "world": 2, "version": 2, "kill_before": 2}]})
    addr = tuple(json.loads(pub.stdout.readline())["addr"])
    live = master(0)
    sub = WeightSubscriber(live, bucket_bytes=SMALL, version=0)
    sub.join(1, 1, 2, addr, peers.secret, timeout_s=10, ready_timeout_s=20)
    assert sub.receive() == 1
    assert sub.digest() == expected_digest(1, "float32")
    with pytest.raises(WeightSyncError):
        sub.receive()
    assert pub.wait(timeout=30) == -9
    assert sub.version == 1 and sub.digest() == expected_digest(1, "float32")
    sub.close()


def test_a_member_killed_in_the_broadcast_fails_every_member_at_once_not_at_the_collective_timeout(peers):
    """4 members; rank 1 dies once the group is formed. gloo's tree sends rank 0 -> 1 -> 3 and
    0 -> 2: rank 0 and rank 3 lose a peer at once, while rank 2 waits on rank 0, which is alive. Before,
    rank 2 waited out the collective's timeout (a run stalled 30 s per such death; gloo aborts no
    receive under way); now rank 0 shuts its group's connections down and rank 2 fails at once.
    The two left then take the next version in a new epoch."""
    pub, weights = publisher(peers.secret)
    timeout_s = 45  # far longer than the test lets anyone wait: a timeout here is the bug
    def ops(rank: int, rejoin: int | None):
        out = [{"op": "join", "epoch": 1, "rank": rank, "world": 4, "timeout_s": timeout_s}, {"op": "receive"}]
        return out + ([{"op": "join", "epoch": 2, "rank": rejoin, "world": 3}, {"op": "receive"}] if rejoin else [])
    subs = [peers.start("sub", {"addr": pub.store_addr, "ops": ops(1, None), "die_in_broadcast": True}),
            peers.start("sub", {"addr": pub.store_addr, "ops": ops(2, 1)}),
            peers.start("sub", {"addr": pub.store_addr, "ops": ops(3, 2)})]
    try:
        with pytest.raises(WeightSyncError) as err:
            pub.serve(1, 4, timeout_s=timeout_s, ready_timeout_s=30)
        assert "Connection closed" in str(err.value) or "Connection reset" in str(err.value), err.value
        weights.update(master(2))
        pub.snapshot(2)
        assert pub.serve(2, 3, timeout_s=20, ready_timeout_s=30) == 2
    finally:
        pub.close()
    assert subs[0].wait(timeout=30) == -9  # it died in the broadcast, as the test meant
    for sub in subs[1:]:
        _, failed, _, again = peers.results(sub, timeout=30)
        assert "Timed out" not in failed["error"] and "Connection" in failed["error"], failed["error"]
        assert failed["version"] == 0
        assert again["received"] == 2 and again["digest"] == expected_digest(2, "float32")


def test_a_layout_mismatch_names_the_first_differing_tensor_before_any_byte_moves(peers):
    pub, _ = publisher(peers.secret)
    sub = peers.start("sub", {"addr": pub.store_addr, "shapes": {"l1.w": [64, 64]},
                              "ops": [{"op": "join", "epoch": 1, "rank": 1, "world": 2}]})
    try:
        with pytest.raises(WeightSyncError) as err:
            pub.serve(1, 2, timeout_s=20, ready_timeout_s=30)
        assert pub._group is None  # no group was formed: not a byte of weights moved
    finally:
        pub.close()
    [joined] = peers.results(sub)
    for text in (joined["error"], str(err.value)):
        assert "'l1.w'" in text and "float32[128, 64] on the publisher" in text and "float32[64, 64]" in text, text
    assert joined["error"].startswith("LayoutMismatchError") and joined["version"] == 0


def test_a_subscriber_busy_longer_than_the_collective_timeout_still_gets_the_version(peers):
    pub, _ = publisher(peers.secret)
    sub = peers.start("sub", {"addr": pub.store_addr, "ops": [
        {"op": "join", "epoch": 1, "rank": 1, "world": 2, "timeout_s": 1}, {"op": "busy", "seconds": 3},
        {"op": "receive"}]})
    try:
        assert pub.serve(1, 2, timeout_s=1, ready_timeout_s=30) == 1  # the 1 s counts from "all ready"
    finally:
        pub.close()
    assert peers.results(sub)[-1]["version"] == 1


def test_a_member_that_never_says_ready_fails_the_round_naming_it_within_the_ready_timeout(peers):
    pub, _ = publisher(peers.secret)
    try:
        with pytest.raises(WeightSyncError, match=r"rank\(s\) \[1\] did not say they were ready within"):
            pub.serve(1, 2, timeout_s=1, ready_timeout_s=0.5)
    finally:
        pub.close()


def test_a_newer_epoch_ends_the_waits_of_an_older_one_on_both_sides(peers):
    pub, _ = publisher(peers.secret)
    sub = WeightSubscriber(master(0), bucket_bytes=SMALL, version=0)
    errors: dict[str, str] = {}

    def run(name, call):
        try:
            call()
        except WeightSyncError as e:
            errors[name] = str(e)

    try:
        sub.join(1, 1, 3, pub.store_addr, peers.secret, timeout_s=1, ready_timeout_s=60)
        # rank 2 never comes, so the publisher waits for it and the subscriber waits for the go
        threads = [threading.Thread(target=run, args=("pub", lambda: pub.serve(1, 3, timeout_s=1, ready_timeout_s=60))),
                   threading.Thread(target=run, args=("sub", sub.receive))]
        for t in threads:
            t.start()
        # the subscriber now waits (seen through a client of our own: a TCPStore client is not shared across threads)
        observer = connect(pub.store_addr, peers.secret, timeout_s=10).child("epoch-1")
        observer.wait(["round-0/ready/1"], timedelta(seconds=10))
        pub.fence(2)
        sub.fence(2)
        for t in threads:
            t.join(timeout=10)  # far below the 60 s they would otherwise wait
        assert not any(t.is_alive() for t in threads)
        assert "epoch 1 is stale" in errors["pub"] and "epoch 1 is stale" in errors["sub"], errors
        assert sub.version == 0
    finally:
        pub.close()
        sub.close()
