"""Links between hosts (flowrl/runtime/protocol/addresses.py): ipc within a host, tcp + CURVE between hosts,
and what a client without the run's keys gets from a data channel, the control channel and the
weight store: nothing. 127.0.0.2 stands in for another host (all of 127.0.0.0/8 is loopback)."""

from __future__ import annotations

import asyncio
import secrets
import types

import pytest
import zmq

from flowrl.graph import load_graph
from flowrl.runtime.protocol.addresses import Network, keypair, tcp_address
from tests.curve_probe import handshake

pytestmark = pytest.mark.timeout(60)
N = "flowrl.testing.nodes"
GRAPH = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  scale: {{kind: "{N}:Scale", replicas: 2}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> scale, scale -> collect]
"""


def network(tmp_path, where: dict[str, str], curve: bool = True) -> Network:
    path = tmp_path / "g.yaml"
    path.write_text(GRAPH)
    net = Network(load_graph(path, check=False), {}, tmp_path / "socks", "127.0.0.1", curve=curve)
    for pid, address in where.items():
        net.place(pid, address)
    return net


def test_an_edge_within_a_host_is_ipc_and_one_between_hosts_is_tcp_on_the_consumers_address_with_its_producers_keys(tmp_path):
    net = network(tmp_path, {"numbers/0/0": "127.0.0.1", "scale/0/0": "127.0.0.1", "scale/1/0": "127.0.0.2",
                             "collect/0/0": "127.0.0.1"})
    assert net.input_address("scale", 0, "in") == f"ipc://{tmp_path}/socks/scale.0.in"
    assert net.input_clients("scale", 0, "in") is None
    assert net.input_address("scale", 1, "in") == "tcp://127.0.0.2:0"  # its producer is on the other host
    assert net.input_clients("scale", 1, "in") == [net.keys["numbers/0/0"][0]]
    # collect is fed by both replicas, one of them elsewhere: tcp for all of its producers
    assert net.input_address("collect", 0, "in") == "tcp://127.0.0.1:0"
    assert net.input_clients("collect", 0, "in") == sorted([net.keys["scale/0/0"][0], net.keys["scale/1/0"][0]])
    assert net.server_key("collect", 0, "tcp://127.0.0.1:5555") == net.keys["collect/0/0"][0]
    assert net.server_key("scale", 0, "ipc:///x") == ""
    # control: ipc on the controller's host, tcp + CURVE from the other host
    assert net.multi_host
    net.control_tcp = "tcp://127.0.0.1:4444"
    assert net.control_address("scale/0/0").startswith("ipc://") and net.control_key("scale/0/0") is None
    assert net.control_address("scale/1/0") == "tcp://127.0.0.1:4444"
    assert net.control_key("scale/1/0") == net.control_keys[0]
    assert len({k for k, _ in net.keys.values()}) == 4  # one key pair per process


def test_one_host_stays_ipc_everywhere_and_curve_off_leaves_tcp_without_keys(tmp_path):
    local = network(tmp_path, {p: "127.0.0.1" for p in ("numbers/0/0", "scale/0/0", "scale/1/0", "collect/0/0")})
    assert not local.multi_host
    assert all(local.input_address(n, r, "in").startswith("ipc://") for n, r in (("scale", 0), ("scale", 1), ("collect", 0)))
    plain = network(tmp_path, {"numbers/0/0": "127.0.0.1", "scale/0/0": "127.0.0.2", "scale/1/0": "127.0.0.2",
                               "collect/0/0": "127.0.0.1"}, curve=False)
    assert plain.input_address("scale", 0, "in") == "tcp://127.0.0.2:0" and plain.input_clients("scale", 0, "in") is None
    assert plain.server_key("scale", 0, "tcp://127.0.0.2:1") == ""


def test_sockets_never_bind_all_interfaces_and_ranks_across_hosts_talk_tcp_with_curve(tmp_path):
    for host in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="all interfaces"):
            tcp_address(host)
    assert tcp_address("fe80::1", 7) == "tcp://[fe80::1]:7"
    net = network(tmp_path, {"scale/0/0": "127.0.0.1", "scale/0/1": "127.0.0.1", "scale/0/2": "127.0.0.2",
                             "scale/0/3": "127.0.0.2"})
    ports = iter(range(7001, 7100))
    where = {r: net.rank_address("scale", 0, r, lambda host: next(ports)) for r in range(4)}
    # the leader hears from followers on both hosts: tcp on its own address; rank 1 hears only from
    # the leader on its own host: ipc; ranks 2 and 3 (host b) hear from the leader on host a: tcp on b
    assert where[0] == "tcp://127.0.0.1:7001" and where[1].startswith("ipc://") and where[1].endswith("scale.0.rank1")
    assert where[2] == "tcp://127.0.0.2:7002" and where[3] == "tcp://127.0.0.2:7003"
    keys = {r: net.keys[f"scale/0/{r}"][0] for r in range(4)}
    assert net.rank_clients("scale", 0, 0) == sorted(keys[r] for r in (1, 2, 3))  # every follower, none else
    assert net.rank_clients("scale", 0, 2) == [keys[0]] and net.rank_clients("scale", 0, 1) is None
    assert net.rank_key("scale", 0, 2, where[2]) == keys[2] and net.rank_key("scale", 0, 1, where[1]) == ""
    plain = network(tmp_path, {"scale/0/0": "127.0.0.1", "scale/0/1": "127.0.0.2"}, curve=False)
    assert plain.rank_clients("scale", 0, 1) is None and plain.rank_key("scale", 0, 1, "tcp://127.0.0.2:1") == ""


async def _data_channel_refuses_a_stranger():
    from flowrl.transport import Batch, ChannelConfig, CurveConfig, Receiver, Sender

    server, producer, secret = keypair(), keypair(), secrets.token_bytes(32)
    async with Receiver(ChannelConfig(transport="tcp", allow_remote=True, secret=secret, curve=CurveConfig(
            server_public=server[0], server_secret=server[1], authorized_clients=(producer[0],))), name="reward.in") as rx:
        address = await rx.bind("tcp://127.0.0.2:0")
        # a stranger that even knows the consumer's public key: ZAP refuses its handshake
        outcome = await asyncio.to_thread(handshake, address, server[0])
        stats = rx.statistics()
        assert outcome == "refused" and stats.peers == 0 and stats.received == 0 and stats.rejected == 0
        # the producer with its own keys gets through (and sends a batch)
        async with Sender(ChannelConfig(secret=secret), name="reward.in") as tx:
            await tx.connect(address, curve=CurveConfig(server_public=server[0], client_public=producer[0],
                                                        client_secret=producer[1]))
            await tx.send(Batch(tensors={}, batch_id="t-1"))
            batch = await asyncio.wait_for(rx.recv(), 10)
            assert batch.batch_id == "t-1"
            await rx.ack(batch)
    return address


def test_a_tcp_data_channel_refuses_a_client_without_a_producers_curve_key():
    address = asyncio.run(_data_channel_refuses_a_stranger())
    assert address.startswith("tcp://127.0.0.2:")


def test_the_control_channel_over_tcp_never_hands_a_strangers_message_to_the_controller(tmp_path):
    from flowrl.runtime.protocol.addresses import bind_control, release_control

    net = network(tmp_path, {"numbers/0/0": "127.0.0.1", "scale/0/0": "127.0.0.2"})
    (tmp_path / "socks").mkdir()
    zctx, router = bind_control(net)
    sync = zmq.Socket.shadow(router.underlying)
    try:
        assert net.control_tcp.startswith("tcp://127.0.0.1:")
        assert handshake(net.control_tcp, net.control_keys[0], send=b"stop, please") == "refused"
        assert not sync.poll(500)  # nothing reached the controller
        assert handshake(net.control_tcp, net.control_keys[0], net.keys["scale/0/0"], send=b"hello") == "succeeded"
        assert sync.poll(5000) and sync.recv_multipart()[-1] == b"hello"
    finally:
        router.close(0)
        release_control(net, zctx)


def test_the_weight_store_on_another_hosts_address_listens_there_only_and_refuses_a_client_without_the_secret():
    from flowrl.weights import WeightPublisher, WeightSubscriber, WeightSyncError
    from tests.weights.peers import master
    from tests.weights.test_store import listening_addresses

    pub = WeightPublisher(lambda: master(1), secret=secrets.token_bytes(32), store_host="127.0.0.2")
    try:
        assert pub.store_addr[0] == "127.0.0.2"
        assert listening_addresses(pub.store_addr[1]) == {"0200007F"}  # 127.0.0.2 only
        with pytest.raises(WeightSyncError, match="cannot join"):
            WeightSubscriber(master(0), version=0).join(1, 1, 2, pub.store_addr, secrets.token_bytes(32),
                                                        timeout_s=1, ready_timeout_s=0.5)
    finally:
        pub.close()
