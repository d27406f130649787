"""Hostile links against a live Receiver: the per-run secret, credit caps and reclaim, answers to
unknown links, checks before unpacking, the pre-hello size limit, replays and strict header types.

A raw pyzmq DEALER in the test plays the hostile (or merely foreign) producer; it speaks the wire
format by hand (`Raw`), so every step of the protocol can be bent.
"""

import contextlib
import hashlib
import hmac
import secrets
import time
from typing import AsyncIterator

import msgpack
import numpy as np
import pytest
import zmq

from flowrl.transport import (
    Batch,
    BrokenChannel,
    DecodeError,
    Receiver,
    Sender,
    decode,
    encode,
    wire,
)
from flowrl.transport.security import proof
from flowrl.transport.sockets import shared_context
from tests.transport.helpers import fast_config, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
SECRET = secrets.token_bytes(32)


def pack(h: dict) -> bytes:
    return msgpack.packb(h, use_bin_type=True)


def hello(**kw) -> bytes:
    h = {"v": wire.SCHEMA_VERSION, "kind": "hello", "ch": "raw", "state": "open", "need": 0, "idle": False,
         "ret_m": 0, "ret_b": 0}
    h.update(kw)
    return pack(h)


def data(seq: int, inc: str, i: int = 0, **over) -> list[bytes]:
    """A batch's frames with envelope [inc, seq] and header fields replaced by `over` (by name)."""
    frames = [bytes(memoryview(f).cast("B")) for f in encode(Batch(tensors={"x": np.arange(4)}, batch_id=f"raw{i}"))]
    return [pack(with_fields(msgpack.unpackb(frames[0]), **{"env": [inc, seq], **over})), *frames[1:]]


def with_fields(header: list, **fields) -> list:
    for name, value in fields.items():
        header[wire.DATA_FIELDS.index(name)] = value
    return header


class Raw:
    """A hand-driven producer link (a DEALER with its own routing id)."""

    def __init__(self, address: str, rid: bytes | None = None):
        self.rid = rid or f"raw.{secrets.token_hex(4)}".encode()
        self.sock = shared_context().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never block: the consumer reads on this same event loop
        self.sock.setsockopt(zmq.ROUTING_ID, self.rid)
        self.sock.connect(address)
        self.statuses: list[wire.Status] = []

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def drain(self) -> list[wire.Status]:
        while True:
            try:
                self.statuses.append(wire.Status.from_header(wire.unpack_header(self.sock.recv(zmq.DONTWAIT),
                                                                                wire.DecodeLimits())))
            except zmq.Again:
                return self.statuses

    async def status(self, want=lambda s: True, timeout: float = 5.0) -> wire.Status:
        seen = len(self.statuses)
        await wait_until(lambda: any(want(s) for s in self.drain()[seen:]), timeout, "a status")
        return next(s for s in self.statuses[seen:] if want(s))

    async def join(self, secret: bytes | None = None, **kw) -> wire.Status:
        """Say hello (proving `secret` on the consumer's nonce when given); the welcome status."""
        self.send(hello(**kw))
        if secret is not None:
            nonce = (await self.status(lambda s: s.nonce is not None)).nonce
            self.send(hello(mac=proof(secret, nonce, self.rid), **kw))
        return await self.status(lambda s: s.known)

    def close(self) -> None:
        self.sock.close(linger=0)


@contextlib.asynccontextmanager
async def bound(tmp_path, **kw) -> AsyncIterator[tuple[Receiver, str]]:
    async with Receiver(fast_config(**kw), name="hostile") as rx:
        yield rx, await rx.bind(f"ipc://{tmp_path}/rx")


async def test_a_producer_that_knows_the_secret_joins_and_one_that_does_not_gets_nothing(tmp_path):
    async with bound(tmp_path, secret=SECRET) as (rx, address), \
            Sender(fast_config(secret=SECRET), name="good") as good, \
            Sender(fast_config(secret=secrets.token_bytes(32), peer_timeout_s=0.5), name="wrong") as wrong, \
            Sender(fast_config(peer_timeout_s=0.5), name="none") as none:
        await good.connect(address)
        await good.send(Batch(tensors={"x": np.arange(3)}, batch_id="ok"))
        await rx.ack(await rx.recv())
        with pytest.raises(BrokenChannel, match="different secrets"):
            await wrong.connect(address)
        with pytest.raises(BrokenChannel, match="requires the channel secret"):
            await none.connect(address)
        st = rx.statistics()
        assert st.peers == 1 and st.received == 1
        assert st.rejected_by_reason.get("bad_proof", 0) >= 1 and st.rejected_by_reason.get("no_proof", 0) >= 1
        await wait_until(lambda: rx.statistics().credit_messages + rx.statistics().in_flight > 0)
        assert wrong.statistics().credit_messages == 0 and none.statistics().credit_messages == 0


async def test_the_secret_never_travels_only_an_hmac_of_the_consumers_nonce_does(tmp_path):
    """A raw ROUTER plays the consumer and records every byte the producer writes."""
    router = shared_context().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/fake")
    async with Sender(fast_config(secret=SECRET), name="tx") as tx:
        await tx.connect(f"ipc://{tmp_path}/fake", wait=False)
        seen: list[list[bytes]] = []

        def got() -> bool:
            while router.poll(0):
                seen.append(router.recv_multipart())
            return bool(seen)

        await wait_until(got)
        rid = seen[0][0]
        nonce = secrets.token_bytes(wire.NONCE_BYTES)
        router.send_multipart([rid, wire.Status(ch="c", inc="fake", known=False, cap_m=4, cap_b=1 << 20,
                                                max_msg=1 << 20, nonce=nonce).to_bytes()])
        await wait_until(lambda: got() and any(b"mac" in m[1] for m in seen))
    router.close()
    everything = b"".join(f for m in seen for f in m)
    assert SECRET not in everything
    mac = next(msgpack.unpackb(m[1])["mac"] for m in seen if b"mac" in m[1])
    assert mac == hmac.new(SECRET, b"flowrl-hello-v1\0" + nonce + rid, hashlib.sha256).digest()


async def test_a_proof_made_for_one_consumer_does_not_open_another(tmp_path):
    async with Receiver(fast_config(secret=SECRET), name="one") as rx1, \
            Receiver(fast_config(secret=SECRET), name="two") as rx2:
        a1, a2 = await rx1.bind(f"ipc://{tmp_path}/1"), await rx2.bind(f"ipc://{tmp_path}/2")
        raw = Raw(a1)
        await raw.join(SECRET)
        stolen = proof(SECRET, rx1._gate.nonce(raw.rid), raw.rid)
        replayer = Raw(a2, rid=raw.rid)
        replayer.send(hello(mac=stolen))
        await wait_until(lambda: rx2.statistics().rejected_by_reason.get("bad_proof") == 1)
        assert rx2.statistics().peers == 0 and rx1.statistics().peers == 1
        raw.close(), replayer.close()


async def test_a_need_above_the_link_cap_is_refused_and_does_not_hold_up_other_producers(tmp_path):
    async with bound(tmp_path, capacity_messages=8, capacity_bytes=1 << 20, link_capacity_messages=4,
                     link_capacity_bytes=1 << 19, credit_idle_s=60) as (rx, address), \
            Sender(fast_config(capacity_messages=8), name="good") as good:  # no reclaim comes to help
        greedy = Raw(address)
        await greedy.join()
        greedy.send(hello(need=(1 << 19) + 1))
        await good.connect(address)
        for i in range(20):  # more than the capacity: grants must keep coming
            await good.send(Batch(tensors={"x": np.arange(3)}, batch_id=f"g{i}"))
            await rx.ack(await rx.recv())
        assert rx.statistics().rejected_by_reason == {"need_too_large": 1}
        greedy.close()


async def test_no_link_holds_more_than_its_cap_and_a_hoarder_is_cut_off_after_credit_idle_s(tmp_path):
    async with bound(tmp_path, capacity_messages=8, link_capacity_messages=2, credit_idle_s=0.3) as (rx, address):
        hoarder = Raw(address)
        welcome = await hoarder.join()
        assert welcome.lim_m == 2 and welcome.cap_m == 2
        assert rx.statistics().credit_messages == 6  # the other six stay in the pool
        # nobody waits for credit: sitting on it past credit_idle_s costs nothing (a producer busy
        # computing between two batches keeps its link)
        t0 = time.monotonic()
        await hoarder.status(lambda s: time.monotonic() - t0 > 1.0)  # heartbeats, 3 x credit_idle_s
        assert rx.statistics().reclaimed == 0 and all(s.known for s in hoarder.statuses)
        # three more links take the rest; a fifth waits for a message: the hoarder is cut off for it
        others = [Raw(address) for _ in range(3)]
        for other in others:
            assert (await other.join()).lim_m == 2
        waiter = Raw(address)
        waiter.send(hello(need=100))
        await hoarder.status(lambda s: not s.known)  # told to start over: its link is gone
        granted = await waiter.status(lambda s: s.known and s.lim_m >= 1)
        assert granted.lim_b >= 100
        st = rx.statistics()
        assert st.reclaimed >= 1 and st.peers >= 2
        for raw in [hoarder, waiter, *others]:
            raw.close()


async def test_replies_to_unknown_links_are_rate_limited(tmp_path):
    async with bound(tmp_path) as (rx, address):
        stranger = Raw(address)
        junk = data(1, "nobody")
        t0 = time.monotonic()
        for _ in range(5000):
            stranger.send(*junk)
        await wait_until(lambda: rx.statistics().rejected == 5000)
        elapsed = time.monotonic() - t0
        answered = 5000 - rx.statistics().replies_dropped
        assert 1 <= answered <= 2 + elapsed / rx.config.heartbeat_s  # one per heartbeat, not one per message
        await wait_until(lambda: len(stranger.drain()) == answered)
        stranger.close()


async def test_a_link_that_never_said_hello_gets_nothing_bigger_than_a_hello_looked_at(tmp_path):
    async with bound(tmp_path) as (rx, address):
        stranger = Raw(address)
        stranger.send(b"\xc1" * 8192)  # not msgpack: unpacked, it would be `bad_msgpack`
        bundle = [pack({"v": wire.SCHEMA_VERSION, "kind": "bundle", "parts": [1] * 1_000_000}), b"\x00" * 1_000_000]
        stranger.send(*bundle)
        await wait_until(lambda: rx.statistics().rejected == 2)
        assert rx.statistics().rejected_by_reason == {"unknown_link": 2}
        stranger.close()


async def test_a_frame_past_the_largest_message_is_cut_off_by_the_socket_unread(tmp_path):
    async with bound(tmp_path, max_message_bytes=1 << 20) as (rx, address):
        stranger = Raw(address)
        mon = stranger.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        stranger.send(b"\x00" * (64 << 20))
        await wait_until(lambda: mon.poll(0))  # the consumer's socket dropped the connection at the length
        assert rx.statistics().rejected == 0 and rx.statistics().received == 0
        stranger.sock.disable_monitor()
        mon.close(linger=0)
        stranger.close()


async def test_a_bundle_of_too_many_parts_is_refused_whole_before_its_parts_are_read(tmp_path):
    async with bound(tmp_path) as (rx, address):
        raw = Raw(address)
        await raw.join()
        n = wire.MAX_BUNDLE_PARTS + 1
        raw.send(pack({"v": wire.SCHEMA_VERSION, "kind": "bundle", "parts": [1] * n}), b"\x00" * n)
        await wait_until(lambda: rx.statistics().rejected == 1)
        assert rx.statistics().rejected_by_reason == {"bundle_parts": 1}
        raw.close()


async def test_a_known_link_sending_past_its_credit_is_refused_before_its_header_is_unpacked(tmp_path):
    async with bound(tmp_path, capacity_bytes=1 << 20) as (rx, address):
        raw = Raw(address)
        assert (await raw.join(idle=True)).lim_b == 0  # an idle link is granted nothing
        raw.send(b"\xc1" * 200_000)  # not msgpack either
        await wait_until(lambda: rx.statistics().rejected == 1)
        assert rx.statistics().rejected_by_reason == {"no_credit": 1}
        raw.close()


async def test_a_batch_replayed_after_its_acknowledgement_is_rejected(tmp_path):
    async with bound(tmp_path) as (rx, address):
        raw = Raw(address)
        welcome = await raw.join()
        frames = data(1, welcome.inc)
        raw.send(*frames)
        await rx.ack(await rx.recv())
        await raw.status(lambda s: 1 in s.acks)
        raw.send(*frames)                                   # the same message again
        raw.send(*data(2, welcome.inc, i=2))                # the next one is fine
        got = await rx.recv()
        assert got.batch_id == "raw2"
        assert rx.statistics().rejected_by_reason == {"replay": 1} and rx.statistics().received == 2
        raw.close()


@pytest.mark.parametrize("lie", [{"policy_version": True}, {"policy_version": 1.0}, {"attempt": True},
                                 {"v": True}, {"v": 1.0}, {"route": [True, 0, 0, None]},
                                 {"route": [0, 1.0, 0, None]}])
def test_header_numbers_must_be_ints_not_bools_or_floats(lie):
    frames = encode(Batch(tensors={"x": np.arange(2)}, batch_id="b", policy_version=1))
    h = with_fields(msgpack.unpackb(bytes(frames[0])), **lie)
    with pytest.raises(DecodeError) as e:
        decode([pack(h), *frames[1:]])
    assert e.value.reason in ("bad_field", "bad_version")


def test_a_hello_mac_and_a_status_nonce_have_exact_sizes():
    with pytest.raises(DecodeError, match="mac"):
        wire.Hello.from_header(msgpack.unpackb(hello(mac=b"x" * 31)))
    st = wire.Status(ch="c", inc="i", known=False, cap_m=1, cap_b=1, max_msg=1, nonce=b"n" * 15)
    with pytest.raises(DecodeError, match="nonce"):
        wire.Status.from_header(msgpack.unpackb(st.to_bytes()))


async def test_acknowledgements_in_a_status_that_could_not_be_written_go_out_in_the_next(tmp_path):
    """Statuses to one link queue at most sockets.OUTBOX_HWM deep (a link that never reads costs no
    more); one dropped there must not lose the acknowledgements it carried."""
    async with bound(tmp_path) as (rx, address):
        raw = Raw(address)
        welcome = await raw.join()
        raw.send(*data(1, welcome.inc))
        await rx.ack(await rx.recv())
        await raw.status(lambda s: 1 in s.acks)
        lost = wire.Status(ch="hostile", inc=welcome.inc, acks=[1], cap_m=1, cap_b=1, max_msg=1).to_bytes()
        rx._on_send_error(zmq.Again(), [raw.rid, lost])  # as the socket reports a full queue
        assert (await raw.status(lambda s: bool(s.acks))).acks == [1]
        raw.close()


async def test_a_bad_part_of_a_bundle_is_refused_alone_and_the_parts_after_it_go_in(tmp_path, monkeypatch):
    """A part that is a data header as the map of schema version 1, with unknown str and bytes keys
    besides, is refused alone (`bad_header`; naming such keys once raised a TypeError, which ended the
    bundle); a bug on one part (here, decoding raises) is logged and that part refused, and the
    bundle's later parts still arrive."""
    from flowrl.transport import codec

    decode_data = codec.decode_data

    def buggy(header, *args, **kw):
        if header[wire.DATA_FIELDS.index("batch_id")] == "raw2":
            raise RuntimeError("a bug on this part")
        return decode_data(header, *args, **kw)

    monkeypatch.setattr(codec, "decode_data", buggy)
    async with bound(tmp_path) as (rx, address):
        raw = Raw(address)
        inc = (await raw.join()).inc
        odd = dict(zip(wire.DATA_FIELDS, msgpack.unpackb(data(2, inc, 9)[0])))
        odd.update({"zz": 1, b"raw": 2})
        parts = [data(1, inc, 1)[0], pack(odd), data(3, inc, 2)[0], data(4, inc, 3)[0]]
        raw.send(pack({"v": wire.SCHEMA_VERSION, "kind": "bundle", "parts": [len(p) for p in parts]}), b"".join(parts))
        got = [(await rx.recv()).batch_id for _ in range(2)]
        assert got == ["raw1", "raw3"]
        assert rx.statistics().rejected_by_reason == {"bad_header": 1, "internal": 1}
        raw.close()


async def test_deeply_nested_values_are_refused_by_name_not_as_internal_errors(tmp_path):
    """A value nested 1,000 deep (1 KB) where an error message quotes it: in the envelope of a known
    link's batch, and as the version of a stranger's array header. Each is a refusal by name; building
    the whole repr raised RecursionError, which the receiver counted as an internal error (and logged
    with a traceback each time)."""
    deep = b"\x91" * 1000 + b"\x01"
    async with bound(tmp_path) as (rx, address):
        raw = Raw(address)
        welcome = await raw.join()
        frames = data(1, welcome.inc, env="DEEP")
        raw.send(frames[0].replace(msgpack.packb("DEEP"), deep), *frames[1:])
        stranger = Raw(address)
        stranger.send(b"\x9a" + deep + msgpack.packb(["data", "b", 0, 0, {}, [], None, None, None])[1:])
        raw.send(*data(2, welcome.inc, i=2))  # the link goes on
        assert (await rx.recv()).batch_id == "raw2"
        await wait_until(lambda: rx.statistics().rejected == 2, what="both refusals")
        assert rx.statistics().rejected_by_reason == {"bad_field": 1, "bad_version": 1}
        raw.close()
        stranger.close()


@pytest.mark.anyio(False)
def test_a_hello_flood_has_freed_its_sockets_and_files_when_it_returns(tmp_path):
    """The stranger's floods (200 fresh sockets each) once shared the tool's context: closed sockets
    hold a context slot and their files until libzmq's reaper frees them, and on a loaded machine the
    floods outran it (socket() failed with EMFILE mid-run). A flood now returns with all of them gone.
    The floods run in a process of their own (nothing else there opens files); the sink is here."""
    import subprocess
    import sys

    script = (
        "import os, random, sys\n"
        "from flowrl.transport import hostile\n"
        "before = len(os.listdir('/proc/self/fd'))\n"
        "for _ in range(3):\n"
        "    hostile.flood(sys.argv[1], random.Random(0))\n"
        "    print(before, len(os.listdir('/proc/self/fd')), flush=True)\n"
    )
    with zmq.Context() as ctx:
        sink = ctx.socket(zmq.ROUTER)
        sink.bind(f"ipc://{tmp_path}/sink")
        out = subprocess.run([sys.executable, "-c", script, f"ipc://{tmp_path}/sink"], capture_output=True,
                             text=True, timeout=25)
        sink.close(linger=0)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = [tuple(map(int, line.split())) for line in out.stdout.splitlines()]
    assert len(counts) == 3 and all(after == before for before, after in counts), counts
