"""Shared memory for large tensor payloads between processes on one host: one copy, no socket bytes.

    # producer (one arena per consumer link)
    arena = ShmArena(budget_bytes=256 << 20)
    ref = arena.put([a, b])          # (block_id, fd, used, offsets), or None: send over the socket
    ...                              # later, when the consumer says block_id is released:
    arena.free(block_id)

    # consumer (one peer per producer link; pid, fd, key from the producer's arena.probe())
    peer = ShmPeer(pid, fd, key, max_bytes=1 << 30)   # ShmUnavailable: use the socket path
    raw = peer.region(block_id, fd, used)             # uint8 view of the block, no copy
    while peer.freed: release(peer.freed.popleft())   # blocks whose every view is garbage

Blocks are anonymous memfds, never files in /dev/shm: whatever process dies, the kernel reclaims
the memory once the last descriptor and mapping are gone, so there is nothing to clean up after a
crash. A consumer reaches a producer's memfd through `/proc/<pid>/fd/<fd>`, which the kernel allows
for processes of the same user (ptrace read access) in the same pid namespace; `probe()` lets it
check that before relying on it. The consumer maps the block itself, so its arrays stay valid after
the producer closes the block or exits.

Each block starts with an ALIGN-byte header (magic, block id) so that a consumer notices a stale or
wrong reference instead of reading someone else's bytes. Blocks are sealed against shrinking:
a consumer touching a page past the end of a shrunk memfd would die of SIGBUS, not get an error.

A region lives as long as the array returned by `region()` and every numpy / torch view derived
from it; when the last one is garbage, its block id is appended to `ShmPeer.freed` (possibly from
another thread: the finalizer only appends) and the consumer tells the producer, who may then
reuse the block. Block ids are stable across reuses, so the consumer's mapping is reused too and
repeated same-size batches cost neither new mappings nor page faults.

Neither class is thread-safe: each is meant to be driven by one event loop.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import hmac
import logging
import mmap
import os
import secrets
import stat
import sys
import weakref
from typing import Any

import numpy as np

from flowrl.transport.errors import TransportError

log = logging.getLogger("flowrl.transport")

ALIGN = 64
"""Alignment of every payload offset, and size of the block header (one cache line; enough for
any dtype, and for SIMD loads)."""

MAGIC = b"FLOWRLSHM1"
MIN_BLOCK = 1 << 20
"""Smallest block (bytes, header included): small batches share one size class."""
PROBE_BYTES = mmap.PAGESIZE
_ID_LEN = 16
_KEY_LEN = 32
_HEX = frozenset("0123456789abcdef")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Python's mmap dup()s the descriptor it maps and keeps it open as long as the mapping; 3.13 can
# skip that (trackfd=False), which halves the descriptors a block costs.
_MMAP_KW: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}


class ShmError(TransportError):
    """A shared-memory reference that cannot be honoured.

    `reason` is a short stable code: `bad_ref` (malformed id or number), `unmappable` (the block
    cannot be opened or mapped), `bad_block` (not one of our blocks, or not the announced one),
    `out_of_bounds` (more bytes announced than the block holds), `too_much_mapped` (over the
    consumer's `max_bytes`), `closed`. A receiver can count rejections by it, as for `DecodeError`.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class ShmUnavailable(ShmError):
    """This consumer cannot map that producer's memory at all: another host, another pid namespace,
    no access to its /proc entries, or a probe that is not the producer's. Use the socket path."""


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Where buffers of these sizes go in a block's data area (ALIGN-aligned offsets) and where the
    last one ends: the `used` bytes of its reference."""
    offsets, end = [], 0
    for n in sizes:
        start = aligned(end)
        offsets.append(start)
        end = start + n
    return offsets, end


def _block_size(needed: int) -> int:
    """The size class holding `needed` bytes: the next power of two, at least MIN_BLOCK."""
    return max(MIN_BLOCK, 1 << (needed - 1).bit_length())


def _is_hex(s: Any, n: int) -> bool:
    return isinstance(s, str) and len(s) == n and set(s) <= _HEX


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _address(mm: mmap.mmap) -> int:
    """Start address of a mapping (the temporary array's buffer export ends with it)."""
    return np.frombuffer(mm, np.uint8).ctypes.data


# ---------------------------------------------------------------------------------------- producer


class _Block:
    __slots__ = ("block_id", "fd", "mm", "view", "capacity", "lent")

    def __init__(self, block_id: str, fd: int, mm: mmap.mmap, capacity: int):
        self.block_id, self.fd, self.mm, self.capacity = block_id, fd, mm, capacity
        self.view = np.frombuffer(mm, np.uint8)  # the whole block, header included
        self.lent = False

    def close(self) -> None:
        self.view = None  # the buffer export must end before the mapping can close
        try:
            self.mm.close()
        finally:
            os.close(self.fd)


class ShmArena:
    """Producer side, one per consumer link: blocks of shared memory lent out by `put()` until the
    consumer hands them back through `free()`.

    `budget_bytes` bounds the sum of the block sizes (free or lent). Memory of a block is only
    committed as far as it is written, so the budget is an upper bound on what the arena can pin,
    not what it uses.
    """

    def __init__(self, budget_bytes: int, *, label: str = "flowrl", window_bytes: int | None = None):
        if not _is_count(budget_bytes):
            raise ValueError(f"budget_bytes must be an int >= 0, not {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.window_bytes = window_bytes  # no new block beyond this much lent (new blocks cost page faults)
        self.label = label
        self._pid = os.getpid()  # a forked child must not write into its parent's blocks
        self._blocks: dict[str, _Block] = {}
        self._reserved = 0
        self._probe: tuple[int, str] | None = None
        self._closed = False
        self._n = dict.fromkeys(("puts", "reuses", "frees", "bad_frees", "fallbacks"), 0)

    # -- consumer handshake

    def probe(self) -> dict:
        """{"pid", "fd", "key"}: a one-page memfd holding `key`, for `ShmPeer` to check it can map
        this process's memory (and that pid/fd really are ours) before any block is announced."""
        if self._closed or os.getpid() != self._pid:
            raise ShmError("closed", "the arena is closed (or belongs to the parent of this forked process)")
        if self._probe is None:
            key = secrets.token_hex(_KEY_LEN // 2)
            fd = os.memfd_create(f"{self.label}-probe", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, PROBE_BYTES)
                os.pwrite(fd, key.encode("ascii"), 0)
            except BaseException:
                os.close(fd)
                raise
            self._probe = (fd, key)
        fd, key = self._probe
        return {"pid": self._pid, "fd": fd, "key": key}

    # -- lending

    def put(self, buffers: list) -> tuple[str, int, int, list[int]] | None:
        """Copy `buffers` (C-contiguous numpy arrays, any dtype) into one block, each at an
        ALIGN-aligned offset of its data area. Returns (block_id, fd, used_bytes, offsets), or None
        when the budget (or the OS) cannot provide a block now: send over the socket then.
        The block is lent until `free(block_id)`."""
        flat = []
        for i, a in enumerate(buffers):
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
                raise ValueError(f"buffer {i}: a C-contiguous numpy array is needed, not {type(a).__name__}"
                                 + (" (not contiguous)" if isinstance(a, np.ndarray) else ""))
            if a.dtype.hasobject:
                raise ValueError(f"buffer {i}: dtype {a.dtype} holds Python objects, not plain bytes")
            flat.append(a.reshape(-1).view(np.uint8))
        offsets, end = layout([f.nbytes for f in flat])
        block = self._take(ALIGN + end)
        if block is None:
            self._n["fallbacks"] += 1
            return None
        for f, off in zip(flat, offsets):
            np.copyto(block.view[ALIGN + off:ALIGN + off + f.nbytes], f)
        block.lent = True
        self._n["puts"] += 1
        return block.block_id, block.fd, end, offsets

    def free(self, block_id: str) -> bool:
        """The consumer released `block_id`: it can be lent again. False (counted as a bad free)
        when the id is unknown or not lent; never raises."""
        block = self._blocks.get(block_id) if isinstance(block_id, str) else None
        if block is None or not block.lent:
            if not self._closed:  # late releases after close are expected, not bad
                self._n["bad_frees"] += 1
            return False
        block.lent = False
        self._n["frees"] += 1
        return True

    def close(self) -> None:
        """Close every block, lent or not (consumers keep their own mappings), and the probe.
        Idempotent; `put()` returns None afterwards."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return  # forked copy: the descriptors are the parent's business (CLOEXEC aside)
        for block in self._blocks.values():
            try:
                block.close()
            except (OSError, BufferError) as e:
                log.warning("shm arena %s: closing block %s: %s", self.label, block.block_id, e)
        self._blocks.clear()
        self._reserved = 0
        if self._probe is not None:
            os.close(self._probe[0])
            self._probe = None

    @property
    def lent(self) -> int:
        """Blocks lent and not yet freed."""
        return sum(b.lent for b in self._blocks.values())

    def stats(self) -> dict:
        return {"blocks": len(self._blocks), "lent": self.lent,
                "bytes_reserved": self._reserved, **self._n}

    def __enter__(self) -> "ShmArena":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- blocks

    def _take(self, needed: int) -> _Block | None:
        """A free block holding `needed` bytes (the smallest that does), else a new one if the
        budget allows, closing free blocks that are too small if that makes room."""
        if self._closed or os.getpid() != self._pid:
            return None
        free = [b for b in self._blocks.values() if not b.lent]
        fits = [b for b in free if b.capacity >= needed]
        if fits:
            self._n["reuses"] += 1
            return min(fits, key=lambda b: b.capacity)
        size = _block_size(needed)
        if self.window_bytes is not None:
            lent = [b.capacity for b in self._blocks.values() if b.lent]
            if len(lent) >= 2 and sum(lent) + size > self.window_bytes:
                return None
        spare = sum(b.capacity for b in free)  # every free block is too small here
        if self._reserved - spare + size > self.budget_bytes:
            return None
        for b in sorted(free, key=lambda b: -b.capacity):
            if self._reserved + size <= self.budget_bytes:
                break
            self._drop(b)
        try:
            return self._create(size)
        except OSError as e:  # out of memory / descriptors: the socket path still works
            log.warning("shm arena %s: cannot create a %d-byte block (%s); sending over the socket",
                        self.label, size, e)
            return None

    def _create(self, size: int) -> _Block:
        block_id = secrets.token_hex(_ID_LEN // 2)
        fd = os.memfd_create(f"{self.label}-{block_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mm = mmap.mmap(fd, size, **_MMAP_KW)
        except BaseException:
            os.close(fd)
            raise
        mm[:len(MAGIC) + _ID_LEN] = MAGIC + block_id.encode("ascii")
        block = _Block(block_id, fd, mm, size)
        self._blocks[block_id] = block
        self._reserved += size
        return block

    def _drop(self, block: _Block) -> None:
        del self._blocks[block.block_id]
        self._reserved -= block.capacity
        block.close()


# ---------------------------------------------------------------------------------------- consumer


class _Holder:
    """What a region's base array points into: keeps the mapping alive, and its death (after the
    last view derived from it) is the release signal."""

    __slots__ = ("__array_interface__", "mm", "__weakref__")

    def __init__(self, mm: mmap.mmap, addr: int, n: int):
        self.mm = mm
        self.__array_interface__ = {"data": (addr, False), "shape": (n,), "typestr": "|u1", "version": 3}


class _Mapping:
    """The consumer's own mapping of one block, and the finalizers of the regions handed out."""

    __slots__ = ("block_id", "fd", "mm", "size", "addr", "regions")

    def __init__(self, block_id: str, fd: int, mm: mmap.mmap, size: int):
        self.block_id, self.fd, self.mm, self.size = block_id, fd, mm, size
        self.addr = _address(mm)
        self.regions: list[weakref.finalize] = []

    def live(self) -> int:
        """Regions still alive; forgets the released ones, returning how many were."""
        before = len(self.regions)
        self.regions = [f for f in self.regions if f.alive]
        return before - len(self.regions)

    def header_ok(self) -> bool:
        return self.mm[:len(MAGIC) + _ID_LEN] == MAGIC + self.block_id.encode("ascii")


class _Retired:
    """A mapping dropped from the cache while regions still use it: still counted as mapped."""

    __slots__ = ("size", "regions")

    def __init__(self, m: _Mapping):
        self.size, self.regions = m.size, m.regions


class ShmPeer:
    """Consumer side, one per producer link: maps the producer's blocks and hands out regions.

    `max_bytes` bounds the memory mapped at once (cached blocks plus blocks still used by live
    regions); blocks no region uses are unmapped to make room, oldest use first.
    """

    def __init__(self, pid: int, fd: int, key: str, *, max_bytes: int):
        if not (_is_count(pid) and _is_count(fd) and _is_count(max_bytes) and _is_hex(key, _KEY_LEN)):
            raise ShmError("bad_ref", f"probe needs ints >= 0 and a {_KEY_LEN}-hex key: "
                                      f"pid={pid!r} fd={fd!r} key={key!r} max_bytes={max_bytes!r}")
        self.pid, self.max_bytes = pid, max_bytes
        self.freed: collections.deque = collections.deque()
        self._cache: dict[str, _Mapping] = {}  # in order of last use
        self._retired: list[_Retired] = []
        self._closed = False
        self._regions = self._released = 0
        try:
            pfd = _open_memfd(pid, fd)
        except OSError as e:
            raise ShmUnavailable("unreachable", f"cannot open fd {fd} of producer pid {pid} through "
                                                f"/proc/{pid}/fd/{fd}: {_os_error(e)}") from None
        try:
            got = os.pread(pfd, _KEY_LEN, 0)
        except OSError as e:
            raise ShmUnavailable("unreachable", f"cannot read fd {fd} of producer pid {pid}: {_os_error(e)}") from None
        finally:
            os.close(pfd)
        if not hmac.compare_digest(got, key.encode("ascii")):
            raise ShmUnavailable("key_mismatch", f"fd {fd} of pid {pid} does not hold the announced key: "
                                                 "another process or pid namespace has that pid")

    def region(self, block_id: str, fd: int, used: int) -> np.ndarray:
        """A writable uint8 array over the first `used` bytes of the block's data area, without
        copying. When it and every view derived from it are garbage, `block_id` is appended to
        `freed` (once per call)."""
        if not (_is_hex(block_id, _ID_LEN) and _is_count(fd) and _is_count(used)):
            raise ShmError("bad_ref", f"block_id={block_id!r} fd={fd!r} used={used!r}")
        if self._closed:
            raise ShmError("closed", "this peer is closed")
        m = self._cache.get(block_id)
        if m is not None and (m.fd != fd or not m.header_ok()):
            self._forget(m)  # the id now names another descriptor or memory: map afresh
            m = None
        if m is None:
            m = self._map(block_id, fd)
        else:
            self._cache[block_id] = self._cache.pop(block_id)  # most recently used last
        if used > m.size - ALIGN:
            raise ShmError("out_of_bounds", f"block {block_id} holds {m.size - ALIGN} data bytes, "
                                            f"{used} announced")
        self._released += m.live()
        holder = _Holder(m.mm, m.addr + ALIGN, used)
        fin = weakref.finalize(holder, self.freed.append, block_id)  # only appends: any thread
        fin.atexit = False
        m.regions.append(fin)
        self._regions += 1
        return np.asarray(holder)

    def close(self) -> None:
        """Forget every mapping; arrays handed out stay valid (their holders keep the mapping).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        for m in list(self._cache.values()):
            self._forget(m)

    def stats(self) -> dict:
        for m in self._cache.values():
            self._released += m.live()
        self._prune_retired()
        return {"blocks_mapped": len(self._cache), "bytes_mapped": self._mapped_bytes(),
                "regions": self._regions, "released": self._released}

    def __enter__(self) -> "ShmPeer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- mappings

    def _mapped_bytes(self) -> int:
        return sum(m.size for m in self._cache.values()) + sum(r.size for r in self._retired)

    def _prune_retired(self) -> None:
        keep = []
        for r in self._retired:
            alive = [f for f in r.regions if f.alive]
            self._released += len(r.regions) - len(alive)
            r.regions = alive
            if alive:
                keep.append(r)
        self._retired = keep

    def _forget(self, m: _Mapping) -> None:
        del self._cache[m.block_id]
        self._released += m.live()
        if m.regions:
            self._retired.append(_Retired(m))
        # no mm.close(): live holders may point into it; the last reference unmaps it

    def _make_room(self, size: int) -> None:
        self._prune_retired()
        for m in list(self._cache.values()):  # least recently used first
            if self._mapped_bytes() + size <= self.max_bytes:
                return
            self._released += m.live()
            if not m.regions:
                self._forget(m)
        if self._mapped_bytes() + size > self.max_bytes:
            raise ShmError("too_much_mapped", f"mapping block of {size} bytes would exceed max_bytes="
                                              f"{self.max_bytes} ({self._mapped_bytes()} mapped and in use)")

    def _map(self, block_id: str, fd: int) -> _Mapping:
        where = f"block {block_id} (fd {fd} of pid {self.pid})"
        try:
            bfd = _open_memfd(self.pid, fd)
        except OSError as e:
            raise ShmError("unmappable", f"{where}: cannot open /proc/{self.pid}/fd/{fd}: {_os_error(e)}") from None
        try:
            size = os.fstat(bfd).st_size
            try:
                seals = fcntl.fcntl(bfd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if size < ALIGN or not seals & fcntl.F_SEAL_SHRINK:
                raise ShmError("bad_block", f"{where}: not a flowrl shared-memory block "
                                            f"({size} bytes, {'sealed' if seals else 'not sealed'})")
            self._make_room(size)
            try:
                mm = mmap.mmap(bfd, size, **_MMAP_KW)
            except (OSError, ValueError) as e:
                raise ShmError("unmappable", f"{where}: mmap of {size} bytes failed: {e}") from None
        finally:
            os.close(bfd)
        m = _Mapping(block_id, fd, mm, size)
        if not m.header_ok():
            head = bytes(mm[:len(MAGIC) + _ID_LEN])
            raise ShmError("bad_block", f"{where}: its header reads {head!r}, not {block_id}")
        self._cache[block_id] = m
        return m


def _open_memfd(pid: int, fd: int) -> int:
    """Open another process's memfd read/write. O_PATH first: opening whatever a wrong fd number
    names (a tty, a device, a FIFO) for real could have side effects; only regular files are."""
    pfd = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(pfd).st_mode):
            raise OSError(errno.EINVAL, "not a memory file (socket, pipe or device)")
        return os.open(f"/proc/self/fd/{pfd}", os.O_RDWR | os.O_CLOEXEC)
    finally:
        os.close(pfd)


def _os_error(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    return f"{name} {e.strerror or e}".strip()
