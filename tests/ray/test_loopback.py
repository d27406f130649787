"""A local Ray cluster stays on loopback: its nodes register as 127.0.0.1 and everything it
started listens on 127.0.0.1 or unix sockets only (flowrl/ray_cluster.py says how)."""

from __future__ import annotations

import os

import pytest

from tests.ray.conftest import HOSTS, is_loopback, listening

pytestmark = pytest.mark.timeout(180)


def test_two_node_cluster_registers_and_listens_on_loopback_only(ray_cluster):
    import psutil
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert sorted(n["NodeName"] for n in nodes) == list(HOSTS)
    assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
    cluster, _ = ray_cluster
    assert cluster.address.startswith("127.0.0.1:")
    ours = [os.getpid()] + [p.pid for p in psutil.Process().children(recursive=True)]
    sockets = listening(ours)
    names = {name for _, name, _ in sockets}
    assert {"gcs_server", "raylet"} <= names, names  # the cluster's own servers are among them
    assert [s for s in sockets if not is_loopback(s[2])] == []


def test_loopback_check_accepts_only_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("::ffff:127.0.0.1") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.2")
