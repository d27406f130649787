"""The weight store binds to one address and seals every key and value with the run's secret."""

from __future__ import annotations

import datetime
import os
import secrets

import pytest
import torch.distributed as dist

from flowrl.weights import (SealedStore, StoreAuthError, WeightPublisher, WeightStore, WeightSubscriber,
                            WeightSyncError)
from flowrl.weights.store import client
from tests.weights.peers import master

pytestmark = pytest.mark.timeout(60)


def listening_addresses(port: int) -> set[str]:
    """Local addresses of this process's LISTEN sockets on `port`, read from /proc/net/tcp and tcp6.
    Only this process's: another process may listen on the same port number at another address (a
    test on the other pytest-xdist worker got [::ffff:127.0.0.1]:port while ours had 127.0.0.2:port)."""
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            ours.add(target[len("socket:["):-1])
    out = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                addr, p = local.split(":")
                if state == "0A" and int(p, 16) == port and inode in ours:  # 0A = LISTEN
                    out.add(addr)
    return out


def raw_client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=5))


def test_the_store_listens_on_loopback_only_and_refuses_all_interfaces():
    store = WeightStore("127.0.0.1")
    assert listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, and nothing on 0.0.0.0 or ::
    store.close()
    for host in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="all interfaces"):
            WeightStore(host)


def test_a_client_without_the_secret_reads_only_noise_and_cannot_join():
    secret = secrets.token_bytes(32)
    pub = WeightPublisher(lambda: master(1), secret=secret)
    try:
        spy = raw_client(pub.store_addr[1])
        keys = spy.list_keys()
        assert keys and all(k.startswith("fw/") and "layout" not in k for k in keys)
        for k in keys:
            assert b"emb" not in spy.get(k) and b"float32" not in spy.get(k)  # the layout is not readable
        wrong = SealedStore(spy, secrets.token_bytes(32))
        assert not wrong.check(["layout"])  # its names lead nowhere
        with pytest.raises(WeightSyncError, match="cannot join"):
            WeightSubscriber(master(0), version=0).join(1, 1, 2, pub.store_addr, secrets.token_bytes(32),
                                                        timeout_s=1, ready_timeout_s=0.5)
    finally:
        pub.close()


def test_values_written_without_the_secret_are_refused_not_acted_on():
    secret = secrets.token_bytes(32)
    pub = WeightPublisher(lambda: master(1), secret=secret)
    pub.snapshot(1)
    try:
        ours = SealedStore(raw_client(pub.store_addr[1]), secret)
        forger = raw_client(pub.store_addr[1])
        # the strongest outsider: it knows which opaque name is which, but not the secret
        forger.set(ours._key("layout"), b"\0" * 80)
        with pytest.raises(StoreAuthError, match="not written with this run's secret"):
            ours.get("layout")
        with pytest.raises(WeightSyncError, match="not written with this run's secret"):
            WeightSubscriber(master(0), version=0).join(1, 1, 2, pub.store_addr, secret, timeout_s=1, ready_timeout_s=1)
        # a genuine sealed value replayed under another key fails too: the key is part of the MAC
        epoch = ours.child("epoch-1")
        epoch.set("round-0/go", "go")
        forger.set(epoch._key("round-0/ready/1"), forger.get(epoch._key("round-0/go")))
        with pytest.raises(WeightSyncError, match="epoch-1/round-0/ready/1 holds a value not written with"):
            pub.serve(1, 2, timeout_s=1, ready_timeout_s=1)
    finally:
        pub.close()


def test_sealed_values_round_trip_and_a_short_secret_is_refused():
    store = SealedStore(dist.HashStore(), b"k" * 32)
    store.set("a", b"\x00\x01hello")
    store.child("epoch-1").set("a", "other")
    assert store.get("a") == b"\x00\x01hello" and store.child("epoch-1").get("a") == b"other"
    with pytest.raises(ValueError, match="at least 16 random bytes"):
        SealedStore(dist.HashStore(), b"short")


def test_a_subscriber_whose_store_accepts_and_never_answers_fails_within_its_timeout():
    # torch's client waits for the answer to its first message without a deadline; the weight sync
    # must not hang on a wrong service at the store's address or a firewall that drops data
    import socket
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="did not answer within 1 s"):
            WeightSubscriber(master(0), version=0).join(1, 1, 2, silent.getsockname(), secrets.token_bytes(32),
                                                        timeout_s=1, ready_timeout_s=0.5)
        assert time.monotonic() - t0 < 10


def test_a_subscriber_joining_the_store_of_a_process_that_died_leaves_when_a_newer_epoch_is_ordered():
    # torch's client retries a refused connection until its timeout: an order of an epoch formed just
    # before the controller heard that the publisher died names its store, and the recovery's newer
    # epoch must end that wait (a rank-0 kill once left the subscriber there 36 s, the recovery with it)
    import socket
    import time

    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        address = gone.getsockname()  # closed below: nothing listens there, each connect is refused
    asked = []

    def stop():
        asked.append(1)
        return "weight-sync epoch 1 is stale: this subscriber is at epoch 2" if len(asked) > 1 else None

    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"left while connecting to the weight store at 127.0.0.1:{address[1]}: "
                                              "weight-sync epoch 1 is stale"):
        client(address, timeout_s=30, stop=stop)
    assert len(asked) == 2 and time.monotonic() - t0 < 10  # the second slice, not the 30 s timeout
    # the subscriber's join passes its fence: fenced while it connects (or before), it leaves at once
    import threading

    sub, out = WeightSubscriber(master(0), version=0), {}

    def join():
        try:
            sub.join(1, 1, 2, address, secrets.token_bytes(32), timeout_s=30)
        except WeightSyncError as e:
            out["error"] = str(e)

    joining = threading.Thread(target=join, daemon=True)
    joining.start()
    sub.fence(2)
    joining.join(10)
    assert not joining.is_alive() and "epoch 1 is stale" in out.get("error", ""), out
