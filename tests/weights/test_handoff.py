"""A weight handoff between two real processes on one device (CPU: the shared-memory region, the
same protocol as CUDA IPC on a GPU): bitwise what a broadcast delivers, whole versions only,
named failures, and nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flowrl.weights.handoff import SharedPublisher
from flowrl.weights.store import SealedStore
from tests.weights.conftest import ROOT
from tests.weights.peers import expected_digest, master

pytestmark = pytest.mark.timeout(90)
SMALL = 32 << 10  # 32 KiB buckets: the test model spans several


def start(peers, cfg: dict) -> subprocess.Popen:
    env = {**os.environ, "FLOWRL_TEST_SECRET": peers.secret, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-m", "tests.weights.handoff_peer", json.dumps(cfg)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peers.procs.append(p)
    return p


def publisher(secret: str, version: int = 1, **kw) -> tuple[SharedPublisher, dict]:
    weights = master(version)
    pub = SharedPublisher(lambda: weights, bucket_bytes=SMALL, secret=secret, region_name="flowrl-test-actor.0.0", **kw)
    pub.snapshot(version)
    return pub, weights


def memfds(name: str) -> list[str]:
    """Every open fd of every process of ours that is the region `name` (a memfd: /proc/PID/fd)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if name in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    found.append(f"{pid}/{fd}")
            except OSError:  # closed meanwhile (the listing's own fd)
                continue
    return found


@pytest.mark.parametrize("target", ["copy", "module"])
def test_a_handoff_delivers_bitwise_what_a_broadcast_delivers(peers, target):
    """fp32 master weights served as bf16: subscriber A takes version 1 by handoff, B by broadcast,
    then A version 2 by handoff and again by broadcast; the region is A's staging buffer only for the round."""
    pub, weights = publisher(peers.secret, serving_dtype="bfloat16")
    base = {"addr": pub.store_addr, "dtype": "bfloat16", "module": target == "module"}
    a = start(peers, {**base, "ops": [{"op": "join", "epoch": 1, "rank": 1, "world": 2}, {"op": "receive"},
                                      {"op": "join", "epoch": 3, "rank": 1, "world": 2}, {"op": "receive"},
                                      {"op": "join", "epoch": 4, "rank": 1, "world": 2, "handoff": False},
                                      {"op": "receive"}]})
    b = start(peers, {**base, "ops": [{"op": "join", "epoch": 2, "rank": 1, "world": 2, "handoff": False},
                                      {"op": "receive"}]})
    try:
        assert pub.serve(1, 2, timeout_s=20, ready_timeout_s=30, handoff=True) == 1
        assert pub.serve(2, 2, timeout_s=20, ready_timeout_s=30) == 1  # the same snapshot, broadcast
        weights.update(master(2))
        pub.snapshot(2)  # into the region: the send buckets live there now
        assert pub.serve(3, 2, timeout_s=20, ready_timeout_s=30, handoff=True) == 2
        assert pub.serve(4, 2, timeout_s=20, ready_timeout_s=30) == 2  # a broadcast epoch again: from the region
        region = pub.region.handle["name"]
        assert memfds(region)  # ours, while the publisher lives
    finally:
        pub.close()
    handed, broadcast = peers.results(a), peers.results(b)
    assert [r.get("received") for r in handed] == [None, 1, None, 2, None, 2], handed
    assert handed[5]["digest"] == handed[3]["digest"]  # back to a broadcast epoch: its own staging again
    assert broadcast[1]["received"] == 1 and "error" not in broadcast[1], broadcast
    assert handed[1]["digest"] == broadcast[1]["digest"] == expected_digest(1, "bfloat16")
    assert handed[3]["digest"] == expected_digest(2, "bfloat16")
    if target == "module":  # the module's own tensors hold it (swap: copied into the subscriber's staging)
        assert handed[3]["module_digest"] == handed[3]["digest"]
    else:  # the region was the staging buffer, let go once the version landed: no copy of our own
        assert handed[1]["staging_bytes"] == handed[3]["staging_bytes"] == 0
        assert broadcast[1]["staging_bytes"] > 0 and handed[5]["staging_bytes"] > 0
    assert memfds(region) == []  # both sides closed: nothing of the region is left anywhere


def test_a_stale_garbled_or_broken_handoff_leaves_the_previous_version_then_a_new_epoch_delivers(peers, monkeypatch):
    pub, weights = publisher(peers.secret)
    ops = [{"op": "join", "epoch": e, "rank": 1, "world": 2} for e in range(1, 5)]
    sub = start(peers, {"addr": pub.store_addr, "ops": [
        ops[0], {"op": "receive"},                           # v1 lands
        ops[1], {"op": "receive"},                           # a stale handle (the fd closed, its number reused)
        ops[2], {"op": "receive", "fault_after": 0},         # breaks after the first bucket
        ops[3], {"op": "receive"}, {"op": "receive"}]})      # a forged offer; the failed epoch takes no more
    try:
        assert pub.serve(1, 2, timeout_s=20, ready_timeout_s=30, handoff=True) == 1
        weights.update(master(2))
        pub.snapshot(2)
        good = dict(pub.region.handle)
        pub.region.handle = dict(good, name=good["name"] + "-old")  # what a restarted publisher's fd would be
        assert pub.serve(2, 2, timeout_s=20, ready_timeout_s=30, handoff=True) == 2  # the subscriber says failed
        pub.region.handle = good
        assert pub.serve(3, 2, timeout_s=20, ready_timeout_s=30, handoff=True) == 2
        real_set = SealedStore.set

        def forge(self, key, value):  # the offer as a client without the run's secret would write it
            if key.endswith("/offer") and not getattr(forge, "done", False):
                forge.done = True
                return self.inner.set(self._key(key), b"\x00" * 80)
            return real_set(self, key, value)

        monkeypatch.setattr(SealedStore, "set", forge)
        assert pub.serve(4, 2, timeout_s=20, ready_timeout_s=30, handoff=True) == 2
    finally:
        pub.close()
    out = peers.results(sub)
    stale, broken, forged, last = out[3], out[5], out[7], out[8]
    assert out[1]["received"] == 1 and out[1]["digest"] == expected_digest(1, "float32")
    for r in (stale, broken, forged):  # still on version 1, bitwise
        assert "received" not in r and r["version"] == 1 and r["digest"] == expected_digest(1, "float32"), r
    assert "not the region" in stale["error"], stale
    assert "injected fault after bucket 0" in broken["error"], broken
    assert "StoreAuthError" in forged["error"] and "secret" in forged["error"], forged
    assert "joined epoch" in last["error"] and last["version"] == 1  # the controller must form a new epoch


def test_a_publisher_killed_during_a_handoff_leaves_a_whole_version_and_no_region_behind(peers):
    """kill -9 of the publisher while the subscriber holds the region: what it mapped stays readable
    until it lets go (the version lands whole), then nothing of the region is left anywhere."""
    from flowrl.weights.handoff import SharedSubscriber

    env = {**os.environ, "FLOWRL_TEST_SECRET": peers.secret, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    pub = subprocess.Popen([sys.executable, "-m", "tests.weights.handoff_peer", "pub",
                            json.dumps({"rounds": 1, "region_name": "flowrl-test-killed"})], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peers.procs.append(pub)
    hello = json.loads(pub.stdout.readline())
    assert memfds(hello["region"]) == [f"{pub.pid}/{fd}" for fd in os.listdir(f"/proc/{pub.pid}/fd")
                                       if hello["region"] in os.readlink(f"/proc/{pub.pid}/fd/{fd}")]
    sub = SharedSubscriber(master(0), bucket_bytes=SMALL, version=0)
    sub.join(1, 1, 2, tuple(hello["addr"]), peers.secret, timeout_s=20, ready_timeout_s=20, handoff=True)
    assert sub.receive(commit=False) == 1  # the region is mapped; the publisher waits for our verdict
    pub.kill()
    pub.wait(timeout=20)
    assert {x.split("/")[0] for x in memfds(hello["region"])} == {str(os.getpid())}  # only our mapping keeps it
    sub.commit(1)  # lands from the mapping; telling the dead publisher fails quietly
    assert memfds(hello["region"]) == []
    assert sub.version == 1 and sub.digest() == expected_digest(1, "float32") and sub.staging == []
    with open(f"/proc/{os.getpid()}/maps") as f:
        assert hello["region"] not in f.read()  # let go: the kernel frees it
    sub.close()
