"""A producer on a host that vanished (no FIN, no RST) is noticed by its consumer within the bound
keepalive gives an idle connection, also while the consumer's statuses to it are in flight, which
is nearly always (one per heartbeat): keepalive probes only a connection with nothing in flight,
so TCP_MAXRT (TCP_USER_TIMEOUT on Linux) bounds the others (flowrl/transport/sockets.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from flowrl.transport import ChannelConfig, Receiver, Sender
from flowrl.transport.sockets import vanished_ms
from tests.transport.vanished_host import one_batch_over_tcp

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


def user_timeouts_ms(port: int) -> list[int]:
    """TCP_USER_TIMEOUT of each of this process's established connections to or from `port`."""
    out = []
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status == psutil.CONN_ESTABLISHED and port in (c.laddr.port, c.raddr.port):
            with socket.socket(fileno=os.dup(c.fd)) as s:
                out.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))
    return out


async def test_both_ends_of_a_tcp_channel_give_up_on_a_silent_peer_within_keepalives_bound():
    config = ChannelConfig(heartbeat_s=0.5, peer_timeout_s=3.0, transport="tcp")
    assert vanished_ms(config) == 6000  # 3 s idle, then 3 probes 1 s apart (keepalive counts whole seconds)
    async with Receiver(config, name="consumer") as rx, Sender(config, name="producer") as tx:
        timeouts = user_timeouts_ms(await one_batch_over_tcp(rx, tx))
    assert timeouts == [6000, 6000], f"the producer's and the consumer's connection: {timeouts}"


def netns_prefix() -> list[str]:
    if not (shutil.which("unshare") and shutil.which("ip") and shutil.which("tc")):
        pytest.skip("needs unshare, ip and tc (util-linux, iproute2) to make a network namespace")
    prefix = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    if subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("cannot make a network namespace here (no root, no unprivileged user namespaces)")
    return prefix


def test_a_consumer_whose_producer_host_vanished_ends_its_wait_with_broken_channel():
    """Without TCP_MAXRT the consumer's recv() waited past the driver's 60 s (the kernel retransmits
    its statuses for ~15 minutes before it gives the connection up)."""
    cmd = [*netns_prefix(), "sh", "-c", f"ip link set lo up && exec {sys.executable} -m tests.transport.vanished_host"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"driver failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    result = json.loads(lines[-1])
    if result["outcome"] == "skip":
        pytest.skip(f"this kernel cannot park a port's packets: {result['text']}")
    assert result["outcome"] == "broken", result
    assert "connection closed" in result["text"], result
