"""A data-parallel replica's group (flowrl/runtime/worker/group.py): a rank that cannot reach its
group's store (refused, or accepted and never answered) fails at start within the deadline, naming
both hosts and the address it tried; gloo
and NCCL are pointed at the interface that holds the rank's host address unless the user chose."""

from __future__ import annotations

import socket
import time
import types

import pytest

from flowrl.placement.network import interface_of
from flowrl.runtime.worker.group import join_node_group, pin_interface


def _spec(**kw):
    base = dict(node="actor", replica=0, rank=1, world_size=2, host="host-b", host_address="127.0.0.1",
                device_type="cpu", secret="s" * 32, proc_id="actor/0/1", env={})
    return types.SimpleNamespace(**{**base, **kw})


def join_fails(port: int) -> str:
    """Rank 1 joining a group whose store is at 127.0.0.1:`port`, with a 2 s deadline: it fails in
    time, naming its own host and the address it tried; returns the error's text."""
    spec = _spec(env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        join_node_group(spec, timeout_s=2.0)
    assert time.monotonic() - t0 < 15
    text = str(e.value)
    assert "rank 1 of 2 on host-b (127.0.0.1)" in text and f"127.0.0.1:{port}" in text and "within 2 s" in text
    return text


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_reach_its_groups_store_fails_within_the_deadline_naming_both_ends(clean_ifname):
    with socket.socket() as s:  # a port nobody listens on: a firewall that rejects, as seen from the rank
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "firewall" in join_fails(port)


@pytest.mark.timeout(60)
def test_a_rank_whose_store_accepts_and_never_answers_fails_within_the_deadline_naming_both_ends(clean_ifname):
    # torch's client waits for the answer to its first message without a deadline: a listener that
    # accepts and says nothing (another service on the port, a middlebox dropping data) held it for good
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        text = join_fails(silent.getsockname()[1])
    assert "did not answer" in text and "firewall" in text


@pytest.fixture
def clean_ifname():
    import os

    saved = {k: os.environ.pop(k, None) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    yield
    for k, v in saved.items():
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v


def test_gloo_is_pointed_at_the_interface_that_holds_the_hosts_address_unless_the_user_chose(monkeypatch, clean_ifname):
    lo = interface_of("127.0.0.1")
    assert lo is not None and interface_of("192.0.2.77") is None  # TEST-NET-1: held by no interface here
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert pin_interface(_spec()) == lo
    import os

    assert os.environ["GLOO_SOCKET_IFNAME"] == lo
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert pin_interface(_spec()) == "eth7"  # the user's choice stands
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert pin_interface(_spec(host_address="192.0.2.77")) is None and "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert pin_interface(_spec(device_type="cuda")) == lo and os.environ["NCCL_SOCKET_IFNAME"] == lo
