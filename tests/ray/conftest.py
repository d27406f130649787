"""A real two-node Ray cluster on loopback for the Ray launcher and inventory tests.

Needs the `ray` extra (`pip install -e ".[ray]"`); every test here is skipped without it. The two
Ray nodes run on this machine, each standing in for a host (`host-a`, `host-b`, 2 CPUs each, with a
custom resource named after the host); everything they start listens on 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import shutil
import tempfile

import pytest

pytest.importorskip("ray")

HOSTS = ("host-a", "host-b")


@pytest.fixture(scope="session")
def ray_cluster():
    """(cluster, {host name: raylet pid}); this process is the cluster's driver."""
    import ray

    from flowrl.ray_cluster import loopback_cluster, loopback_node_args

    temp_dir = tempfile.mkdtemp(prefix="frl-ray-")
    cluster = loopback_cluster(num_cpus=2, node_name=HOSTS[0], temp_dir=temp_dir, resources={"host_a": 1},
                               no_monitor=True)
    try:
        worker = cluster.add_node(**loopback_node_args(num_cpus=2, node_name=HOSTS[1], temp_dir=temp_dir,
                                                       resources={"host_b": 1}))
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        raylets = {HOSTS[0]: cluster.head_node.all_processes["raylet"][0].process.pid,
                   HOSTS[1]: worker.all_processes["raylet"][0].process.pid}
        yield cluster, raylets
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or loopback written as an IPv4-mapped IPv6 address (::ffff:127.0.0.1)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def listening(pids) -> list[tuple[int, str, str]]:
    """(pid, process name, ip) of every TCP/UDP socket the processes listen on or are bound to."""
    import psutil

    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            conns = p.net_connections(kind="inet")
            name = p.name()
        except psutil.Error:
            continue
        for c in conns:
            if c.laddr and (c.status == psutil.CONN_LISTEN or (c.status == psutil.CONN_NONE and not c.raddr)):
                out.append((pid, name, c.laddr.ip))
    return out


def alive(pids) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out
