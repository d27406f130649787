"""Security defaults: private ipc folders, loopback tcp, no address stealing, CURVE on loopback."""

import os
import stat

import numpy as np
import pytest
import zmq

from flowrl.transport import Batch, BrokenChannel, ChannelConfig, CurveConfig, Receiver, Sender
from flowrl.transport.errors import AddressInUse
from tests.transport.helpers import fast_config

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def roundtrip(rx_cfg: ChannelConfig, tx_cfg: ChannelConfig) -> Batch:
    async with Receiver(rx_cfg, name="sec") as rx, Sender(tx_cfg, name="sec") as tx:
        await tx.connect(await rx.bind())
        await tx.send(Batch(tensors={"x": np.arange(3)}, batch_id="secret"))
        got = await rx.recv()
        await rx.ack(got)
        return got


async def test_ipc_sockets_live_in_an_owner_only_folder_removed_on_close():
    async with Receiver(fast_config(transport="ipc"), name="a->b") as rx:
        path = (await rx.bind())[len("ipc://"):]
        folder = os.path.dirname(path)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not os.path.exists(folder)


async def test_tcp_binds_loopback_by_default():
    async with Receiver(fast_config(transport="tcp"), name="t") as rx:
        assert (await rx.bind()).startswith("tcp://127.0.0.1:")


async def test_leaving_the_host_needs_allow_remote():
    with pytest.raises(ValueError, match="allow_remote"):
        await Receiver(fast_config(), name="t").bind("tcp://0.0.0.0:0")
    async with Sender(fast_config(), name="t") as tx:
        with pytest.raises(ValueError, match="allow_remote"):
            await tx.connect("tcp://192.0.2.1:5555")


async def test_a_second_consumer_cannot_take_a_live_ipc_address(tmp_path):
    cfg = fast_config(peer_timeout_s=0.2)
    async with Receiver(cfg, name="a") as first:
        address = await first.bind(f"ipc://{tmp_path}/a")
        with pytest.raises(AddressInUse, match="live process"):
            await Receiver(cfg, name="a").bind(address)


async def test_curve_encrypts_and_authenticates_a_loopback_tcp_link():
    server_public, server_secret = CurveConfig.keypair()
    rx_cfg = fast_config(transport="tcp", curve=CurveConfig(server_public=server_public, server_secret=server_secret))
    tx_cfg = fast_config(transport="tcp", curve=CurveConfig(server_public=server_public))
    assert (await roundtrip(rx_cfg, tx_cfg)).batch_id == "secret"
    assert server_secret not in repr(rx_cfg)  # secrets stay out of logs


async def test_a_producer_without_the_right_server_key_cannot_connect():
    server_public, server_secret = CurveConfig.keypair()
    wrong_public, _ = CurveConfig.keypair()
    rx_cfg = fast_config(transport="tcp", curve=CurveConfig(server_public=server_public, server_secret=server_secret))
    async with Receiver(rx_cfg, name="sec") as rx:
        address = await rx.bind()
        for tx_cfg in (fast_config(peer_timeout_s=0.3, curve=CurveConfig(server_public=wrong_public)),
                       fast_config(peer_timeout_s=0.3)):  # and one without CURVE at all
            async with Sender(tx_cfg, name="sec") as tx:
                with pytest.raises(BrokenChannel):
                    await tx.connect(address)


async def test_only_authorized_client_keys_may_connect():
    server_public, server_secret = CurveConfig.keypair()
    good_public, good_secret = CurveConfig.keypair()
    bad_public, bad_secret = CurveConfig.keypair()
    rx_cfg = fast_config(transport="tcp", curve=CurveConfig(server_public=server_public, server_secret=server_secret,
                                                            authorized_clients=(good_public,)))
    async with Receiver(rx_cfg, name="sec") as rx:
        address = await rx.bind()
        bad = CurveConfig(server_public=server_public, client_public=bad_public, client_secret=bad_secret)
        async with Sender(fast_config(peer_timeout_s=0.3, curve=bad), name="sec") as tx:
            with pytest.raises(BrokenChannel):
                await tx.connect(address)
        good = CurveConfig(server_public=server_public, client_public=good_public, client_secret=good_secret)
        async with Sender(fast_config(curve=good), name="sec") as tx:
            await tx.connect(address)
            await tx.send(Batch(tensors={"x": np.arange(2)}, batch_id="ok"))
            assert (await rx.recv()).batch_id == "ok"


async def test_a_running_receiver_admits_a_new_producer_key_and_refuses_a_revoked_one():
    """`flowrl scale` across hosts: a consumer's admitted set changes while it runs (ZAP reads it at
    each handshake); a revoked key is refused from its next connection on."""
    import anyio

    from flowrl.transport import security
    from tests.curve_probe import handshake

    server_public, server_secret = CurveConfig.keypair()
    first, added = CurveConfig.keypair(), CurveConfig.keypair()
    rx_cfg = fast_config(transport="tcp", curve=CurveConfig(server_public=server_public, server_secret=server_secret,
                                                            authorized_clients=(first[0],)))

    def probe(address, client):
        return anyio.to_thread.run_sync(lambda: handshake(address, server_public, client, send=None))

    async with Receiver(rx_cfg, name="sec") as rx:
        address = await rx.bind()
        assert await probe(address, added) == "refused"
        rx.admit(add=[added[0]])
        assert security.admitted(rx._domain) == {first[0], added[0]}
        assert await probe(address, added) == "succeeded"
        async with Sender(fast_config(curve=CurveConfig(server_public=server_public, client_public=added[0],
                                                        client_secret=added[1])), name="sec") as tx:
            await tx.connect(address)
            await tx.send(Batch(tensors={"x": np.arange(2)}, batch_id="new producer"))
            got = await rx.recv()
            assert got.batch_id == "new producer"
            await rx.ack(got)
        rx.admit(remove=[added[0]])
        assert await probe(address, added) == "refused"
        assert await probe(address, first) == "succeeded"  # the others stay admitted


def test_curve_keys_are_checked_when_configured():
    with pytest.raises(ValueError, match="40 Z85"):
        CurveConfig(server_public="short")
    public, _ = CurveConfig.keypair()
    with pytest.raises(ValueError, match="both client_public and client_secret"):
        CurveConfig(server_public=public, client_public=public)
    assert zmq.has("curve")


async def test_a_frame_over_the_size_limit_never_reaches_the_decoder():
    cfg = fast_config(transport="tcp", max_message_bytes=1 << 16)
    async with Receiver(cfg, name="big") as rx:
        address = await rx.bind()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(address)
            sock.send(b"x" * (1 << 17))  # ZeroMQ drops the connection at MAXMSGSIZE
            async with Sender(cfg, name="big") as tx:
                await tx.connect(address)
                await tx.send(Batch(tensors={"x": np.arange(4)}, batch_id="fine"))
                assert (await rx.recv()).batch_id == "fine"
                with pytest.raises(ValueError, match="max message"):
                    await tx.send(Batch(tensors={"x": np.zeros(1 << 14)}, batch_id="too big"))
        finally:
            sock.close()
