"""Channels over shared memory: large batches on ipc channels travel through the producer's memfd
blocks (`shm.py`) instead of the socket.

Covered: round trips of every kind of tensor, block reuse, a consumer that holds on to its batches
(the producer falls back to the socket instead of stalling), arrays outliving their producer (closed
or exited), kill -9 of a consumer with batches lent in shared memory, consumers without shared
memory, tcp / inproc (never shared memory), forged shared-memory references from foreign sockets
(some naming the memory of other processes), consumers mapping less than producers lend, and a
block the consumer fails to map. Helper processes run `peer.py` (see `helpers.spawn_peer`) or
`OWNER`; steps are ordered on their events and on `wait_until`, never on sleeps.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys

import anyio
import msgpack
import numpy as np
import pytest
import zmq

from flowrl.transport import Batch, BrokenChannel, ChannelConfig, EndOfStream, Receiver, Sender, wire
from flowrl.transport.shm import MIN_BLOCK, ShmArena, ShmError, ShmPeer
from tests.transport.helpers import deliver_to_holding_peer, fast_config, spawn_peer, spawn_python, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

MiB = 1 << 20
KiB = 1 << 10


# ------------------------------------------------------------------------------------------ helpers
def ipc(tmp_path, name: str = "ch") -> str:
    return f"ipc://{tmp_path}/{name}"


def link_of(tx: Sender):
    """The sender's only link (its current one: a lost link is replaced at the same address)."""
    (link,) = tx._links.values()
    return link


def arena_stats(tx: Sender) -> dict:
    return link_of(tx).arena.stats()


def rx_shm_stats(rx: Receiver) -> list[dict]:
    """Shared-memory statistics of every producer link of `rx` that mapped its producer's memory."""
    return [p.shm.stats() for p in rx._peers.values() if p.shm is not None]


def big(i: int, n: int = MiB // 8) -> Batch:
    """A batch of ~1.5 MiB whose every byte depends on `i` (sent through shared memory)."""
    rng = np.random.default_rng(i)
    return Batch(tensors={"x": np.arange(n, dtype=np.int64) + i * n,
                          "y": rng.standard_normal((n, 1), dtype=np.float32)},
                 meta={"i": i}, batch_id=f"b{i}")


def assert_same(got: Batch, sent: Batch) -> None:
    """Same ids, meta, tensor names, kinds (numpy / torch), dtypes, shapes and values."""
    assert (got.batch_id, got.attempt, got.policy_version) == (sent.batch_id, sent.attempt, sent.policy_version)
    assert got.meta == sent.meta
    assert list(got.tensors) == list(sent.tensors)
    torch = sys.modules.get("torch")
    for name, s in sent.tensors.items():
        g = got.tensors[name]
        assert type(g) is type(s), f"{name}: {type(g).__name__} arrived for a {type(s).__name__}"
        assert g.dtype == s.dtype and tuple(g.shape) == tuple(s.shape), (name, g.dtype, g.shape, s.dtype, s.shape)
        if isinstance(s, np.ndarray):
            assert np.array_equal(g, s), name
        else:
            assert torch.equal(g, s), name


def check_all(held: list[Batch], first: int = 0) -> None:
    for i, b in enumerate(held, first):
        assert_same(b, big(i))


def snapshot(b: Batch) -> Batch:
    """A deep copy: what the batch held when it was sent, whatever happens to its buffers later."""
    return Batch(tensors={k: v.copy() if isinstance(v, np.ndarray) else v.clone() for k, v in b.tensors.items()},
                 meta=dict(b.meta), batch_id=b.batch_id, attempt=b.attempt, policy_version=b.policy_version)


@contextlib.asynccontextmanager
async def channel(tmp_path, cfg: ChannelConfig, rx_cfg: ChannelConfig | None = None):
    """A connected ipc channel in this process (`rx_cfg`: the consumer's config, if another)."""
    async with Receiver(rx_cfg or cfg, name="shm") as rx, Sender(cfg, name="shm") as tx:
        await tx.connect(await rx.bind(ipc(tmp_path)))
        yield rx, tx


# ------------------------------------------------------------------------------------------ one process
async def test_tensors_of_every_kind_round_trip_through_shared_memory_and_small_batches_do_not(tmp_path):
    torch = pytest.importorskip("torch")
    cfg = fast_config(capacity_messages=8, shm_min_bytes=256 * KiB)
    async with channel(tmp_path, cfg) as (rx, tx):
        link = link_of(tx)
        assert link.arena is not None and link.shm_ok, "the consumer did not map the producer's probe"
        n = 1 << 17
        g = torch.Generator().manual_seed(0)
        sent = Batch(tensors={
            "ids": np.arange(n, dtype=np.int64) * 3 - 5,                                    # 1 MiB
            "obs": np.random.default_rng(0).standard_normal((n, 2), dtype=np.float32),     # 1 MiB
            "logp": torch.randn(n, generator=g).to(torch.bfloat16),
            "half": torch.randn(n, 2, generator=g, dtype=torch.float16),
            "mask": torch.rand(n, generator=g) > 0.5,
            "act": torch.randint(-128, 128, (n, 3), generator=g, dtype=torch.int8),
            "strided": torch.arange(2 * n, dtype=torch.int32).reshape(2, n).t(),           # not contiguous
            "ret": torch.tensor(-1.25, dtype=torch.float64),                               # 0-d (inline)
            "scale": np.array(7, dtype=np.int16),                                          # 0-d numpy
            "nothing": torch.zeros((n, 0), dtype=torch.float32),                           # empty
            "nothing_np": np.zeros((n, 0), dtype=np.uint8),
        }, meta={"step": 3, "tags": ["a", {"b": None}]}, batch_id="big", attempt=1, policy_version=7)
        expected = snapshot(sent)
        await tx.send(sent)
        got = await rx.recv()
        assert_same(got, expected)
        assert arena_stats(tx)["puts"] == 1 and arena_stats(tx)["fallbacks"] == 0
        assert [s["regions"] for s in rx_shm_stats(rx)] == [1]
        assert tx.statistics().shm == rx.statistics().shm == 1  # what the metrics report per edge
        assert tx.statistics().shm_bytes == rx.statistics().shm_bytes > sent.nbytes - 64 * KiB  # tiny ones: inline
        await rx.ack(got)
        await wait_until(lambda: tx.statistics().acked == 1)
        sent.tensors["ids"][:] = 0  # the consumer's arrays are the one copy in shared memory, not these
        sent.tensors["logp"].zero_()
        assert_same(got, expected)

        # below shm_min_bytes (counting only tensors outside the header): the socket
        small = Batch(tensors={"x": np.arange(256 * KiB // 8 - 1, dtype=np.int64),
                               "inline": np.ones((256 * KiB // 8 - 1, 0), np.float32)}, batch_id="small")
        edge = Batch(tensors={"x": np.arange(256 * KiB // 8, dtype=np.int64)}, batch_id="edge")
        for b, puts in ((small, 1), (edge, 2)):
            await tx.send(b)
            got_b = await rx.recv()
            assert_same(got_b, b)
            assert arena_stats(tx)["puts"] == puts, b.batch_id
            await rx.ack(got_b)
        del got_b, b
        gc.collect()
        await wait_until(lambda: arena_stats(tx)["lent"] == 1, what="the small block handed back")

        # the block is lent while any view of any tensor of the batch lives, then handed back
        (peer,) = [p for p in rx._peers.values() if p.shm is not None]
        view = got.tensors["logp"][5:10]
        keep = view.clone()
        del got
        gc.collect()
        assert not peer.shm.freed and arena_stats(tx)["lent"] >= 1
        assert torch.equal(view, keep)
        del view
        gc.collect()
        await wait_until(lambda: arena_stats(tx)["lent"] == 0, what="every block handed back")
        assert arena_stats(tx)["frees"] == 2 and arena_stats(tx)["bad_frees"] == 0
        assert rx.statistics().rejected == 0


async def test_blocks_are_reused_when_the_consumer_drops_each_batch(tmp_path):
    blocks = 3  # of MIN_BLOCK: each batch below fits one
    cfg = fast_config(capacity_messages=4, shm_window_bytes=blocks * MIN_BLOCK)
    async with channel(tmp_path, cfg) as (rx, tx):
        count = 50
        most_blocks = 0

        async def produce():
            for i in range(count):
                await tx.send(big(i, n=64 * KiB))
            await tx.end_of_stream()

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            for i in range(count):
                b = await rx.recv()
                assert_same(b, big(i, n=64 * KiB))  # a reused block never shows an older batch
                await rx.ack(b)
                del b
                most_blocks = max(most_blocks, arena_stats(tx)["blocks"])
        st = arena_stats(tx)
        assert most_blocks <= blocks and st["blocks"] <= blocks
        assert st["reuses"] > 0 and st["puts"] >= count // 4, st
        assert st["bad_frees"] == 0
        assert rx.statistics().received == count and rx.statistics().rejected == 0


async def test_a_consumer_holding_every_batch_makes_the_producer_use_the_socket_not_wait(tmp_path):
    blocks = 2  # the least window there is
    cfg = fast_config(capacity_messages=16, shm_window_bytes=1)
    async with channel(tmp_path, cfg) as (rx, tx):
        link = link_of(tx)
        held = []
        count = 3 * blocks
        for i in range(count):  # credit for all of them: only shared memory could run out
            await tx.send(big(i))
        for i in range(count):
            b = await rx.recv()
            await rx.ack(b)  # acknowledged, yet kept (a replay buffer, say): its block stays lent
            held.append(b)
        del b
        check_all(held)
        st = arena_stats(tx)
        assert st["puts"] == blocks and st["blocks"] == blocks and st["lent"] == blocks, st
        assert st["fallbacks"] >= 1 and link.shm_starved
        assert sum(s["regions"] for s in rx_shm_stats(rx)) == blocks

        # while the blocks are held, later batches do not overwrite them
        await tx.send(big(count))
        b = await rx.recv()
        assert_same(b, big(count))
        await rx.ack(b)
        del b
        check_all(held)

        held.clear()
        gc.collect()
        await wait_until(lambda: arena_stats(tx)["lent"] == 0, what="held blocks handed back")
        assert not link.shm_starved
        for i in range(count + 1, count + 1 + blocks):
            await tx.send(big(i))
            b = await rx.recv()
            assert_same(b, big(i))
            await rx.ack(b)
            del b
        st = arena_stats(tx)
        assert st["puts"] == 2 * blocks and st["reuses"] >= blocks and st["blocks"] == blocks, st


async def test_received_arrays_stay_valid_after_the_producer_and_the_consumer_close(tmp_path):
    async with channel(tmp_path, fast_config(capacity_messages=8)) as (rx, tx):
        for i in range(3):
            await tx.send(big(i))
        held = []
        for _ in range(3):
            held.append(await rx.recv())
            await rx.ack(held[-1])
        assert arena_stats(tx)["puts"] == 3
        await wait_until(lambda: tx.statistics().acked == 3)
        await tx.aclose()
        assert link_of(tx).arena._closed  # the producer closed (and unmapped) every block
        gc.collect()
        check_all(held)
        held[0].tensors["x"][:] = -1  # still writable memory: the consumer's own mapping
        assert (held[0].tensors["x"] == -1).all()
    gc.collect()
    check_all(held[1:], first=1)  # and after the consumer closed too


async def test_a_consumer_without_shared_memory_gets_large_batches_over_the_socket(tmp_path):
    async with channel(tmp_path, fast_config(capacity_messages=4),
                        rx_cfg=fast_config(capacity_messages=4, shm_bytes=0)) as (rx, tx):
        link = link_of(tx)
        assert link.arena is not None and not link.shm_ok
        for i in range(5):
            await tx.send(big(i))
            b = await rx.recv()
            assert_same(b, big(i))
            await rx.ack(b)
        assert arena_stats(tx)["puts"] == 0 and arena_stats(tx)["blocks"] == 0
        assert tx.statistics().shm == rx.statistics().shm == 0
        assert all(p.shm is None for p in rx._peers.values())
        assert rx.statistics().rejected == 0


@pytest.mark.parametrize("kind", ["tcp", "inproc", "ipc-producer-off"])
async def test_channels_without_shared_memory_carry_large_batches_over_the_socket(kind, tmp_path):
    if kind == "ipc-producer-off":
        rx_cfg, tx_cfg = fast_config(capacity_messages=4), fast_config(capacity_messages=4, shm_bytes=0)
    else:
        rx_cfg = tx_cfg = fast_config(transport=kind, capacity_messages=4)
    async with Receiver(rx_cfg, name="shm") as rx, Sender(tx_cfg, name="shm") as tx:
        await tx.connect(await rx.bind(ipc(tmp_path) if kind.startswith("ipc") else None))
        link = link_of(tx)
        assert link.arena is None and not link.shm_ok
        for i in range(3):
            await tx.send(big(i))
            b = await rx.recv()
            assert_same(b, big(i))
            await rx.ack(b)
        assert all(p.shm is None for p in rx._peers.values())


# ------------------------------------------------------------------------------------------ processes
async def test_received_arrays_stay_valid_after_the_producer_process_exits(tmp_path):
    count, size = 6, MiB
    async with Receiver(fast_config(capacity_messages=4, peer_timeout_s=5.0), name="test->peer") as rx:
        address = await rx.bind(ipc(tmp_path))
        async with spawn_peer("producer", address, "--count", str(count), "--size", str(size),
                              "--capacity", "4") as producer:
            await producer.next_event("ready")
            held = []
            for i in range(count):
                held.append(await rx.recv())
                if i < count - 1:  # the producer waits for the last acknowledgement: it is alive till then
                    await rx.ack(held[-1])
            assert sum(s["regions"] for s in rx_shm_stats(rx)) == count, "not sent through shared memory"
            await rx.ack(held[-1])
            await producer.next_event("done")
            with anyio.fail_after(20):
                assert await producer.process.wait() == 0
        with pytest.raises(EndOfStream):
            await rx.recv()
        gc.collect()
        for i, b in enumerate(held):
            assert b.batch_id == f"b{i}"
            assert b.tensors["x"].shape == (size // 8,) and (b.tensors["x"] == i).all()


async def test_a_killed_consumer_process_gets_its_batches_lent_in_shared_memory_resent_to_its_restart(tmp_path):
    address = ipc(tmp_path, "consumer")
    cfg = fast_config(capacity_messages=8, peer_timeout_s=5.0)
    sent = {i: big(i, n=64 * KiB) for i in range(12)}
    expected = {i: snapshot(b) for i, b in sent.items()}
    async with Sender(cfg, name="test->peer") as tx:
        async with spawn_peer("consumer", address, "--capacity", "8", "--hold-after", "3") as first:
            events = await deliver_to_holding_peer(first, tx, address, [sent[i] for i in range(8)], acked=3)
            first_link = link_of(tx)
            assert first_link.shm_ok and first_link.arena.stats()["puts"] == 8
            first.kill()  # mid-stream: b3..b7 delivered through shared memory, not acknowledged
            # the restart comes after the loss is noticed (as a supervisor's does): else batches sent
            # on the old link meanwhile are re-sent too (at-least-once; here, `resent` would be 8)
            await wait_until(lambda: tx.statistics().peers_lost == 1)
        assert [(e["batch_id"], e["first"]) for e in events] == [(f"b{i}", i * 64 * KiB) for i in range(8)]
        async with Receiver(cfg, name="test->peer") as second:
            await second.bind(address)  # the restart, at the same address (here, in this process)
            got = []

            async def finish():
                for i in range(8, 12):
                    await tx.send(sent[i])
                await tx.end_of_stream()

            async with anyio.create_task_group() as tg:
                tg.start_soon(finish)
                while True:
                    try:
                        b = await second.recv()
                    except EndOfStream:
                        break
                    got.append(b.batch_id)
                    assert_same(b, expected[int(b.batch_id[1:])])
                    await second.ack(b)
                    del b
            second_link = link_of(tx)
            assert second_link is not first_link and second_link.shm_ok
            assert second_link.arena.stats()["puts"] >= 1  # re-sent batches went through shared memory too
        # every batch not acknowledged by the first incarnation reaches the second, in order, once, intact
        assert got == [f"b{i}" for i in range(3, 12)]
        assert tx.statistics().resent == 5 and tx.take_returned() == []
        assert not first_link.arena._closed  # open a while: batches sent just before a loss stay mappable
    assert first_link.arena._closed  # and closed with the sender


async def test_batches_lent_to_a_killed_consumer_that_never_returns_are_handed_back_intact(tmp_path):
    address = ipc(tmp_path, "consumer")
    sent = [big(i, n=64 * KiB) for i in range(4)]
    expected = [snapshot(b) for b in sent]
    async with Sender(fast_config(capacity_messages=8, peer_timeout_s=0.5), name="test->peer") as tx:
        async with spawn_peer("consumer", address, "--capacity", "8", "--hold-after", "1") as consumer:
            await deliver_to_holding_peer(consumer, tx, address, sent, acked=1)
            assert link_of(tx).arena.stats()["puts"] == 4
            consumer.kill()
        await wait_until(lambda: tx.statistics().returned == 3)
        returned = tx.take_returned()
        assert [b.batch_id for b in returned] == ["b1", "b2", "b3"]
        for b, e in zip(returned, expected[1:]):
            assert_same(b, e)
        with pytest.raises(BrokenChannel, match="no consumer replica"):
            await tx.send(big(9, n=64 * KiB))


# ------------------------------------------------------------------------------------------ forged references
OWNER = r"""
import json, os, socket, sys, tempfile
import numpy as np
from flowrl.transport.shm import ShmArena
arena = ShmArena(16 << 20, label="owner")
block_id, fd, used, _ = arena.put([np.arange(4096, dtype=np.int64)])
pipe_r, pipe_w = os.pipe()
sock = socket.socket()
plain = tempfile.TemporaryFile()
plain.truncate(1 << 20)
print(json.dumps({"event": "ready", "probe": arena.probe(), "ref": [block_id, fd, used], "pipe": pipe_r,
                  "socket": sock.fileno(), "file": plain.fileno()}), flush=True)
sys.stdin.read()
"""
"""A process owning a shared-memory block (and a pipe, a socket, a plain file), for references
that name another process's memory: each owner's pid serves one forged reference only, since a
consumer may give up on shared memory with a process whose reference failed."""


def spawn_owner():
    return spawn_python("-c", OWNER)


@contextlib.contextmanager
def dealer(address: str, rid: bytes):
    """A plain pyzmq DEALER speaking to the consumer directly (no Sender behind it). Keep it open
    until no new connection comes: a consumer that sees its disconnection after a new connection
    took the same descriptor number drops that new link too (the event names only the fd)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, rid)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()


async def test_forged_shared_memory_references_are_rejected_and_counted_while_good_traffic_flows(tmp_path):
    cfg = fast_config(capacity_messages=32)
    address = ipc(tmp_path)
    async with Receiver(cfg, name="shm") as rx, Sender(cfg, name="shm") as tx, contextlib.AsyncExitStack() as stack:
        await tx.connect(await rx.bind(address))
        assert link_of(tx).shm_ok
        owners = [await stack.enter_async_context(spawn_owner()) for _ in range(6)]
        seq = itertools.count(1)
        expected: dict[str, int] = {}

        def hello(probe=None, state="open") -> bytes:
            return wire.Hello(ch="intruder", state=state, shm=probe).to_bytes()

        def data(ref, offset=0, dtype="int64", shape=(4096,), with_ref=True) -> bytes:
            header = [wire.SCHEMA_VERSION, "data", f"forged{next(seq)}", 0, -1, {},
                      [["x", dtype, list(shape), "numpy", offset, None]], None, [rx._inc, next(seq)],
                      ref if with_ref else None]
            return msgpack.packb(header, use_bin_type=True)

        async def join(sock, rid: bytes, probe=None) -> None:
            """A hello; returns once the consumer knows the link, tried its probe and granted credit."""
            sock.send(hello(probe))

            def ready() -> bool:
                peer, account = rx._peers.get(rid), rx._pool.accounts.get(rid)
                return (peer is not None and peer.shm_tried == (probe is not None) and account is not None
                        and account.unused_m >= 1 and account.unused_b >= 2 * MIN_BLOCK)
            await wait_until(ready, what=f"link {rid!r} ready")

        async def leave(sock, rid: bytes) -> None:
            sock.send(hello(state="bye"))  # its credit goes back (if the consumer did not drop it already)
            await wait_until(lambda: rid not in rx._peers)

        async def rejected(sock, reason: str, *frames: bytes) -> None:
            expected[reason] = expected.get(reason, 0) + 1
            sock.send_multipart(list(frames))
            total = sum(expected.values())
            await wait_until(lambda: rx.statistics().rejected >= total, what=f"rejection ({reason})")
            assert rx.statistics().rejected_by_reason == expected

        with ShmArena(16 * MiB, label="intruder") as arena:
            x = np.arange(4096, dtype=np.int64)
            block_id, fd, used, _ = arena.put([x])
            ref = [block_id, fd, used]

            # a link whose probe mapped (this process's memory): malformed or inconsistent references
            sock = stack.enter_context(dealer(address, b"mapped"))  # open till the end (see dealer)
            await join(sock, b"mapped", arena.probe())
            assert rx._peers[b"mapped"].shm is not None
            await rejected(sock, "bad_ref", data(["not-a-block-id!!", fd, used]))        # not an id
            await rejected(sock, "bad_ref", data([block_id, -1, used]))                   # not an fd
            await rejected(sock, "out_of_bounds", data(ref, offset=8))                    # tensor past `used`
            await rejected(sock, "out_of_bounds", data(ref, offset=-64))
            await rejected(sock, "out_of_bounds", data(ref, shape=(4097,)))
            await rejected(sock, "bad_value", data(ref, dtype="bool", shape=(used,)))     # bool bytes > 1
            await rejected(sock, "bad_field", data([block_id, fd], shape=(0,)))           # malformed refs
            await rejected(sock, "bad_field", data([block_id, fd, -1]))
            await rejected(sock, "frame_index", data(ref, with_ref=False))  # no block named: 0 is no frame
            await rejected(sock, "bad_field", data(ref), x.tobytes())                     # plus a frame
            # a well-formed reference is honoured (the frames above were forged only where meant)
            sock.send(data(ref))
            got = await rx.recv()
            assert got.batch_id.startswith("forged") and np.array_equal(got.tensors["x"], x)
            await rx.ack(got)
            del got
            await leave(sock, b"mapped")

            # links that announced no probe, or a probe whose key is wrong, cannot use shared memory
            for rid, probe in ((b"no-probe", None), (b"bad-key", {**arena.probe(), "key": "0" * 32})):
                sock = stack.enter_context(dealer(address, rid))  # open till the end (see dealer)
                await join(sock, rid, probe)
                assert rx._peers[rid].shm is None
                await rejected(sock, "bad_field", data(ref))
                await leave(sock, rid)

            # references the consumer cannot follow into another process's memory: one link and one
            # owner process each (the consumer may drop such a link and refuse that process's memory)
            infos = [await owner.next_event("ready") for owner in owners]
            cases = [("bad_block", lambda o: ["0123456789abcdef", o["ref"][1], o["ref"][2]]),   # another id
                     ("bad_block", lambda o: [o["ref"][0], o["file"], o["ref"][2]]),            # not sealed
                     ("unmappable", lambda o: [o["ref"][0], o["pipe"], o["ref"][2]]),           # a pipe
                     ("unmappable", lambda o: [o["ref"][0], o["socket"], o["ref"][2]]),         # a socket
                     ("unmappable", lambda o: [o["ref"][0], 999_999, o["ref"][2]]),             # no such fd
                     ("out_of_bounds", lambda o: [o["ref"][0], o["ref"][1], MIN_BLOCK])]         # more than the block
            for k, (info, (reason, forge)) in enumerate(zip(infos, cases)):
                rid = f"owner{k}".encode()
                sock = stack.enter_context(dealer(address, rid))  # open till the end (see dealer)
                await join(sock, rid, info["probe"])
                assert rx._peers[rid].shm is not None
                await rejected(sock, reason, data(forge(info)))
                await leave(sock, rid)

        # the channel's own traffic is untouched
        for i in range(3):
            await tx.send(big(i))
            b = await rx.recv()
            assert_same(b, big(i))
            await rx.ack(b)
            del b
        assert arena_stats(tx)["puts"] == 3 and arena_stats(tx)["bad_frees"] == 0
        st = rx.statistics()
        assert st.received == 4 and st.rejected == sum(expected.values()) == 18
        assert st.rejected_by_reason == expected
        assert tx.statistics().rejected == 0
        await wait_until(lambda: tx.statistics().in_flight == 0)


# ------------------------------------------------------------------------------------------ budgets
async def test_a_consumer_mapping_less_than_the_producer_lends_still_gets_every_batch(tmp_path):
    # (failed before the producer learned the consumer's limit: the third batch was rejected as
    # too_much_mapped and never delivered)
    async with channel(tmp_path, fast_config(capacity_messages=8),
                       rx_cfg=fast_config(capacity_messages=8, shm_bytes=4 * MiB)) as (rx, tx):
        for i in range(3):
            await tx.send(big(i))  # 2 MiB blocks: the consumer can map two of them at once
        await wait_until(lambda: rx.statistics().received + rx.statistics().rejected >= 3)
        assert rx.statistics().rejected_by_reason == {}
        assert arena_stats(tx)["bytes_reserved"] <= 4 * MiB and arena_stats(tx)["puts"] == 2
        held = []
        for i in range(3):
            held.append(await rx.recv())
            await rx.ack(held[-1])
        check_all(held)


async def test_one_batch_too_large_for_the_arena_does_not_turn_shared_memory_off_for_good(tmp_path):
    # (failed before: the batch that fit no block marked the link starved, and as no block was
    # lent none was ever freed to clear it)
    cfg = fast_config(capacity_messages=4, shm_bytes=4 * MiB)
    async with channel(tmp_path, cfg) as (rx, tx):
        for b in [Batch(tensors={"x": np.zeros(5 * MiB // 8, np.int64)}, batch_id="huge")] + \
                 [big(i, n=64 * KiB) for i in range(3)]:
            await tx.send(b)
            got = await rx.recv()
            assert got.batch_id == b.batch_id
            await rx.ack(got)
            del got
        assert arena_stats(tx)["puts"] == 3, arena_stats(tx)


async def test_a_block_the_consumer_cannot_map_costs_no_batch(tmp_path, monkeypatch):
    """A well-formed reference the consumer fails to follow (here: a mapping refused once) must
    not lose the batch: the producer sends it again, over the socket if need be."""
    real_region = ShmPeer.region
    failures = []

    def region(self, block_id, fd, used):
        if not failures:
            failures.append(block_id)
            raise ShmError("unmappable", f"block {block_id}: refused once by the test")
        return real_region(self, block_id, fd, used)

    monkeypatch.setattr(ShmPeer, "region", region)
    async with channel(tmp_path, fast_config(capacity_messages=4, peer_timeout_s=5.0)) as (rx, tx):
        got = []
        finished = anyio.Event()

        async def produce():
            for i in range(6):
                await tx.send(big(i, n=64 * KiB))
            await tx.end_of_stream()

        async def consume():
            while True:
                try:
                    b = await rx.recv()
                except EndOfStream:
                    break
                assert_same(b, big(int(b.batch_id[1:]), n=64 * KiB))
                got.append(b.batch_id)
                await rx.ack(b)
                del b
            finished.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            tg.start_soon(consume)
            await wait_until(lambda: finished.is_set() or tx.statistics().rejected > 0, what="the stream to end")
            tg.cancel_scope.cancel()
        assert tx.statistics().rejected == 0, "the producer refused a status of its consumer (see the log)"
        assert failures and rx.statistics().rejected_by_reason.get("unmappable") == 1
        assert set(rx.statistics().rejected_by_reason) <= {"unmappable", "unknown_link"}
        assert sorted(got, key=lambda s: int(s[1:])) == [f"b{i}" for i in range(6)]
        assert len(got) == len(set(got)) == 6 and tx.take_returned() == []


# ------------------------------------------------------------------------------------------ sizes at the edges
async def test_bundles_stay_within_what_the_consumer_accepts(tmp_path):
    # (failed before: a bundle of small batches could exceed the consumer's max_message_bytes; ZeroMQ
    # then dropped the connection, the re-sent burst was bundled again, and the stream never ended)
    rx_cfg = fast_config(capacity_messages=64, max_message_bytes=100_000)
    async with channel(tmp_path, fast_config(capacity_messages=64), rx_cfg=rx_cfg) as (rx, tx):
        batches = [Batch(tensors={f"t{k}": np.full(1000, i * 4 + k, np.int64) for k in range(4)}, batch_id=f"s{i}")
                   for i in range(40)]  # each ~32 KB in one frame: 3 fit the limit, 40 do not
        for b in batches:
            await tx.send(b)
        for b in batches:
            got = await rx.recv()
            assert_same(got, b)
            await rx.ack(got)
        assert tx.statistics().peers_lost == 0 and tx.statistics().resent == 0
        assert rx.statistics().rejected == 0


def many_frames(i: int, tensors: int = 150) -> Batch:
    """Many tensors just over the inline limit: the shared-memory form's header and padding grow most."""
    return Batch(tensors={f"t{k}": np.full(8193, (i + k) % 251, np.uint8) for k in range(tensors)}, batch_id=f"m{i}")


def socket_size(b: Batch) -> int:
    from flowrl.transport import codec

    prepared = codec.prepare(b)
    return len(prepared.frames({"inc": "0" * 16, "seq": 1})[0]) + prepared.payload_bytes


async def test_a_shared_memory_batch_never_needs_more_credit_than_was_checked(tmp_path):
    # (failed before: with many tensors the padding and the longer references outgrew the allowance;
    # the consumer rejected the batch as sent without credit and it was never delivered)
    b = many_frames(0)
    old_allowance = 64 + 64 * len(b.tensors)  # what the sender used to add for the shared-memory form
    cfg = fast_config(capacity_messages=1, capacity_bytes=socket_size(b) + old_allowance)
    async with channel(tmp_path, cfg) as (rx, tx):
        for i in range(3):
            with anyio.fail_after(10):
                await tx.send(many_frames(i))
                got = await rx.recv()
            assert_same(got, many_frames(i))
            await rx.ack(got)
            del got
        assert rx.statistics().rejected == 0
    async with channel(tmp_path, fast_config(capacity_messages=2)) as (rx, tx):  # room: shared memory
        await tx.send(b)
        got = await rx.recv()
        assert_same(got, b)
        assert tx.statistics().shm == 1 and rx.statistics().rejected == 0


async def test_a_batch_that_fits_the_socket_is_not_refused_for_its_shared_memory_form(tmp_path):
    # (failed before: a ValueError "consumers accept less", though the same batch fits over the socket)
    b = many_frames(0)
    cfg = fast_config(capacity_messages=2, capacity_bytes=socket_size(b) + 10)
    async with channel(tmp_path, cfg) as (rx, tx):
        await tx.send(b)
        got = await rx.recv()
        assert_same(got, b)
        await rx.ack(got)
        assert tx.statistics().shm == 0 and rx.statistics().rejected == 0
