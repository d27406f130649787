"""Shared-memory blocks: round trips in one process and across processes, release tracking through
numpy and torch views, block reuse, the budget, malformed references, close()."""

import gc
import multiprocessing
import os
import subprocess

import numpy as np
import pytest

from flowrl.transport.shm import ALIGN, MIN_BLOCK, ShmArena, ShmError, ShmPeer, ShmUnavailable, aligned

MiB = 1 << 20


def peer_of(arena: ShmArena, max_bytes: int = 64 * MiB) -> ShmPeer:
    p = arena.probe()
    return ShmPeer(p["pid"], p["fd"], p["key"], max_bytes=max_bytes)


def at(region: np.ndarray, offset: int, like: np.ndarray) -> np.ndarray:
    """The bytes of `like`'s size at `offset` of a region, seen as `like`'s dtype and shape."""
    return region[offset:offset + like.nbytes].view(like.dtype).reshape(like.shape)


def inputs():
    return [np.arange(1000, dtype=np.int64), np.linspace(0, 1, 333, dtype=np.float32).reshape(3, 111)]


def test_aligned():
    assert [aligned(n) for n in (0, 1, 63, 64, 65, 128)] == [0, 64, 64, 64, 128, 128]


def test_round_trip_in_one_process_shares_memory_instead_of_copying():
    a, b = inputs()
    with ShmArena(16 * MiB) as arena, peer_of(arena) as peer:
        block_id, fd, used, offsets = arena.put([a, b])
        assert offsets == [0, aligned(a.nbytes)] and used == offsets[1] + b.nbytes
        region = peer.region(block_id, fd, used)
        assert region.dtype == np.uint8 and region.shape == (used,) and region.flags.writeable
        assert np.array_equal(at(region, offsets[0], a), a) and np.array_equal(at(region, offsets[1], b), b)
        at(region, offsets[0], a)[:3] = [-7, -8, -9]  # the producer's memory sees the write
        seen = np.frombuffer(os.pread(fd, 24, ALIGN + offsets[0]), np.int64)
        assert seen.tolist() == [-7, -8, -9]
        assert arena.stats()["puts"] == 1 and peer.stats()["regions"] == 1


def test_every_dtype_and_odd_shapes_are_copied_bytewise():
    arrays = [np.array(3.5), np.zeros((2, 0), np.int32), np.array([True, False, True]),
              np.arange(7, dtype=np.uint16), np.arange(6, dtype=np.complex64).reshape(2, 3)]
    with ShmArena(4 * MiB) as arena, peer_of(arena) as peer:
        block_id, fd, used, offsets = arena.put(arrays)
        assert all(o % ALIGN == 0 for o in offsets)
        region = peer.region(block_id, fd, used)
        for arr, off in zip(arrays, offsets):
            assert np.array_equal(at(region, off, arr), arr)
        with pytest.raises(ValueError, match="contiguous"):
            arena.put([np.arange(10)[::2]])
        with pytest.raises(ValueError, match="objects"):
            arena.put([np.array(["x", None], dtype=object)])


def _producer(conn):
    """Child process: lends two arrays, waits for the word to close, closes, exits."""
    with ShmArena(16 * MiB, label="child") as arena:
        a, b = inputs()
        conn.send((arena.put([a * 3, b + 1]), arena.probe()))
        assert conn.recv() == "close"
    conn.send("closed")


@pytest.mark.timeout(60)
def test_across_processes_arrays_outlive_the_producer():
    import torch  # here, not at the top: the spawned producer imports this module

    a, b = inputs()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(30), "producer did not answer"
        (block_id, fd, used, offsets), probe = parent.recv()
        assert probe["pid"] == proc.pid
        peer = ShmPeer(probe["pid"], probe["fd"], probe["key"], max_bytes=64 * MiB)
        region = peer.region(block_id, fd, used)
        x, y = at(region, offsets[0], a), torch.from_numpy(at(region, offsets[1], b))
        assert np.array_equal(x, a * 3) and torch.equal(y, torch.from_numpy(b + 1))
        parent.send("close")
        assert parent.poll(30) and parent.recv() == "closed"
        proc.join(30)
        assert proc.exitcode == 0
        # our own mapping survives the producer's close() and exit
        assert np.array_equal(x, a * 3) and torch.equal(y, torch.from_numpy(b + 1))
        with pytest.raises(ShmError) as e:
            peer.region("0" * 16, fd, 8)  # nothing new can be mapped from a dead process
        assert e.value.reason == "unmappable"
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def test_release_comes_after_the_last_numpy_and_torch_view_then_the_block_is_reused():
    import torch

    a, b = inputs()
    with ShmArena(16 * MiB) as arena, peer_of(arena) as peer:
        block_id, fd, used, offsets = arena.put([a, b])
        region = peer.region(block_id, fd, used)
        views = {
            "numpy slice": at(region, offsets[0], a)[10:20],
            "torch float32": torch.from_numpy(at(region, offsets[1], b))[1],
            "torch bfloat16": torch.from_numpy(region[offsets[1]:offsets[1] + 64].view(np.int16)).view(torch.bfloat16),
        }
        assert views["numpy slice"][0] == 10 and views["torch float32"][0].item() == b[1, 0]
        del region
        for name in list(views):
            gc.collect()
            assert not peer.freed, f"released while views remain (before deleting the {name})"
            del views[name]
        gc.collect()
        assert list(peer.freed) == [block_id] and peer.stats()["released"] == 1
        peer.freed.popleft()

        assert arena.free(block_id)
        before = arena.stats()
        again = arena.put([a * 2, b * 2])
        assert again[:2] == (block_id, fd) and again[2:] == (used, offsets)
        after = arena.stats()
        assert after["reuses"] == 1 and after["blocks"] == before["blocks"] == 1
        region = peer.region(*again[:3])  # same id, same fd: the cached mapping, no new one
        assert np.array_equal(at(region, offsets[0], a), a * 2) and peer.stats()["blocks_mapped"] == 1


def test_budget_falls_back_to_the_socket_and_recovers_after_free():
    small = [np.zeros(100_000, np.uint8)]
    with ShmArena(2 * MiB) as arena:
        first, second = arena.put(small), arena.put(small)
        assert first and second and first[0] != second[0]
        assert arena.stats()["blocks"] == 2 and arena.stats()["bytes_reserved"] == 2 * MIN_BLOCK
        assert arena.put(small) is None and arena.stats()["fallbacks"] == 1
        assert arena.put([np.zeros(3 * MiB, np.uint8)]) is None  # bigger than the whole budget
        assert arena.free(first[0])
        again = arena.put(small)
        assert again is not None and again[0] == first[0]
        s = arena.stats()
        assert (s["blocks"], s["lent"], s["reuses"], s["fallbacks"]) == (2, 2, 1, 2)


def test_free_blocks_too_small_are_closed_to_make_room_for_a_bigger_one():
    with ShmArena(4 * MiB) as arena:
        ids = [arena.put([np.zeros(1000, np.uint8)])[0] for _ in range(2)]
        assert arena.put([np.zeros(3 * MiB, np.uint8)]) is None  # both small blocks still lent
        assert all(arena.free(i) for i in ids)
        big = arena.put([np.zeros(3 * MiB, np.uint8)])
        assert big is not None and big[0] not in ids
        s = arena.stats()
        assert (s["blocks"], s["bytes_reserved"], s["lent"]) == (1, 4 * MiB, 1)
        assert arena.free(big[0])
        small = arena.put([np.zeros(1000, np.uint8)])  # the big free block fits: reused, not a new one
        assert small[0] == big[0] and arena.stats()["blocks"] == 1


def test_free_of_unknown_or_not_lent_ids_is_counted_not_raised():
    with ShmArena(4 * MiB) as arena:
        block_id = arena.put([np.zeros(10, np.uint8)])[0]
        assert arena.free(block_id) is True
        assert arena.free(block_id) is False  # twice
        assert arena.free("f" * 16) is False and arena.free(None) is False
        assert arena.stats()["frees"] == 1 and arena.stats()["bad_frees"] == 3


@pytest.mark.timeout(60)
def test_peer_refuses_a_probe_it_cannot_verify():
    with ShmArena(4 * MiB) as arena:
        p = arena.probe()
        with pytest.raises(ShmUnavailable) as e:
            ShmPeer(p["pid"], p["fd"], "0" * 32, max_bytes=MiB)
        assert e.value.reason == "key_mismatch"
        dead = subprocess.Popen(["true"])
        dead.wait()
        with pytest.raises(ShmUnavailable, match=f"pid {dead.pid}") as e:
            ShmPeer(dead.pid, p["fd"], p["key"], max_bytes=MiB)
        assert e.value.reason == "unreachable" and "ENOENT" in str(e.value)
        r, w = os.pipe()
        try:
            for fd in (r, 1000 + r):  # a pipe, then a number that is no descriptor
                with pytest.raises(ShmUnavailable, match=f"fd {fd}"):
                    ShmPeer(p["pid"], fd, p["key"], max_bytes=MiB)
        finally:
            os.close(r)
            os.close(w)
        for bad in [dict(pid=-1), dict(fd="3"), dict(key="xyz"), dict(key="A" * 32), dict(max_bytes=True)]:
            args = {**p, "max_bytes": MiB, **bad}
            with pytest.raises(ShmError) as e:
                ShmPeer(args["pid"], args["fd"], args["key"], max_bytes=args["max_bytes"])
            assert e.value.reason == "bad_ref" and not isinstance(e.value, ShmUnavailable)


def test_region_rejects_malformed_or_wrong_references():
    with ShmArena(8 * MiB) as arena, peer_of(arena) as peer:
        block_id, fd, used, _ = arena.put([np.zeros(10, np.uint8)])
        other_id, other_fd, _, _ = arena.put([np.zeros(10, np.uint8)])
        cases = [
            (("xyz", fd, used), "bad_ref"),
            ((block_id.upper(), fd, used), "bad_ref"),
            ((block_id, -1, used), "bad_ref"),
            ((block_id, fd, -1), "bad_ref"),
            ((block_id, fd, 1.5), "bad_ref"),
            ((block_id, True, used), "bad_ref"),
            ((block_id, 99_999, used), "unmappable"),           # no such descriptor
            ((block_id, other_fd, used), "bad_block"),         # another block's memory
            ((block_id, arena.probe()["fd"], used), "bad_block"),  # not a block at all
            ((block_id, fd, MIN_BLOCK - ALIGN + 1), "out_of_bounds"),
        ]
        for args, reason in cases:
            with pytest.raises(ShmError) as e:
                peer.region(*args)
            assert e.value.reason == reason, (args, str(e.value))
        assert peer.region(block_id, fd, MIN_BLOCK - ALIGN).shape == (MIN_BLOCK - ALIGN,)
        assert peer.region(other_id, other_fd, 0).shape == (0,)


def test_max_bytes_bounds_the_mapped_memory_and_idle_blocks_make_room():
    with ShmArena(8 * MiB) as arena, peer_of(arena, max_bytes=MIN_BLOCK) as peer:
        first = arena.put([np.ones(10, np.uint8)])
        second = arena.put([np.ones(10, np.uint8)])
        held = peer.region(*first[:3])
        with pytest.raises(ShmError) as e:
            peer.region(*second[:3])
        assert e.value.reason == "too_much_mapped"
        del held
        gc.collect()
        assert list(peer.freed) == [first[0]]
        assert peer.region(*second[:3])[0] == 1  # the idle first block was unmapped to make room
        s = peer.stats()
        assert (s["blocks_mapped"], s["bytes_mapped"], s["regions"], s["released"]) == (1, MIN_BLOCK, 2, 2)


def test_close_is_idempotent_and_arrays_stay_valid():
    a, b = inputs()
    arena = ShmArena(8 * MiB)
    peer = peer_of(arena)
    block_id, fd, used, offsets = arena.put([a, b])
    view = at(peer.region(block_id, fd, used), offsets[0], a)
    arena.close()
    arena.close()
    peer.close()
    peer.close()
    assert np.array_equal(view, a)  # the peer's own mapping outlives both closes
    assert arena.put([a]) is None and arena.stats()["fallbacks"] == 1
    assert arena.stats()["blocks"] == 0 and arena.free(block_id) is False
    with pytest.raises(ShmError) as e:
        peer.region(block_id, fd, used)
    assert e.value.reason == "closed"
    with pytest.raises(ShmError):
        arena.probe()
    del view
    gc.collect()
    assert list(peer.freed) == [block_id]
