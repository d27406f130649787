"""Weights between colocated processes on one device: a handoff of the publisher's buffer, not a broadcast.

When a trainer and a rollout share a device (`colocate_with` with the same devices, or a
`take_turns` group), the controller orders a sync epoch with `handoff` set: no bytes go through
gloo or NCCL. The publisher's send buckets live in one shared region; what travels, sealed by the
run's secret in the epoch's store, is the region's handle; the subscriber maps the region and
reads the version from it.

    pub = SharedPublisher(model.state_dict, device="cpu", secret=s, region_name="flowrl-run-actor.0.0")
    pub.snapshot(3)                                       # into the region (the send buckets)
    pub.serve(epoch, 2, timeout_s=30, ready_timeout_s=60, handoff=True)      # the trainer's thread
    sub = SharedSubscriber(engine.weights(), device="cpu")
    sub.join(epoch, 1, 2, store_addr, s, handoff=True)
    version = sub.receive(commit=False)                   # the region mapped: staging IS the region
    sub.commit(version)                                   # copied into the live weights; the region let go

The region: on a GPU one CUDA allocation whose IPC handle (`torch.multiprocessing.reductions.
reduce_tensor`) the subscriber opens (`rebuild_cuda_tensor`); on a CPU the same protocol over an
anonymous shared-memory file (`memfd_create`, named `region_name` for `ls -l /proc/PID/fd`) that
the subscriber maps through `/proc/PUBLISHER_PID/fd/N` (read-only). Nothing is ever named in a
file system: when both sides are gone (closed, or kill -9) the kernel frees it, so no cleanup can
be missed. A CUDA region dies with the publisher (torch's IPC reference counters live in its
`torch_shm_manager` files, which it removes).

A round (keys under the epoch's sealed store, `handshake` for the first two):

    round-R/ready/RANK   the subscriber is between batches (inside its turn, when it takes turns)
    round-R/offer        the publisher: version, layout digest, the region's handle
    round-R/go           the publisher: "go" (or "abort: WHY")
    round-R/done/RANK    the subscriber: "ok" once the version landed, or "failed: WHY"

Guarantees, as a broadcast's: a version lands whole or not at all. The publisher holds its lock
(no `snapshot` can write the region) from the offer until every subscriber said done, or until
`ready_timeout_s + timeout_s` (a subscriber's land may wait for its running sequences); so the
region cannot change under a reader. An offer that fails authentication (`StoreAuthError`), names
another layout, or a region that is gone or is not the one named (the memfd's name carries a
fresh nonce) fails the round with a WeightSyncError and leaves the subscriber's weights as they
were. A subscriber whose live weights are a dict of tensors or a loader (the builtin, hf and vLLM
engines) uses the region itself as its staging buffer, mapped only for the round: between rounds,
and so while it sleeps between turns, it holds no copy of the weights. A subscriber that swaps an
`nn.Module`'s storage copies the region into its own staging buffer and says done at once.
`FLOWRL_WEIGHT_HANDOFF=0` in the controller's environment turns the handoff off (the broadcast).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import mmap
import os
import pickle
import secrets
import time
import warnings
from typing import Any

from flowrl.weights.buckets import BucketPlan, itemsize
from flowrl.weights.errors import WeightSyncError
from flowrl.weights.handshake import announce, await_release, forget, gather, release
from flowrl.weights.layout import layout_digest
from flowrl.weights.publisher import WeightPublisher
from flowrl.weights.store import blocking, wait_until
from flowrl.weights.subscriber import WeightSubscriber

log = logging.getLogger("flowrl.weights")
ENV = "FLOWRL_WEIGHT_HANDOFF"  # "0" in the controller's environment: broadcasts only (controller/weightorders.py)
ALIGN = 256  # every bucket starts at a multiple of this many bytes in the region


def plan_offsets(plan: BucketPlan) -> tuple[list[tuple[int, int]], int]:
    """Where each bucket lives in a region: [(byte offset, byte size)], and the region's size."""
    out, at = [], 0
    for i, (dtype, _, _) in enumerate(plan.buckets):  # as allocated: the last with its version slot
        size = plan.wire_numel(i) * itemsize(dtype)
        out.append((at, size))
        at += -(-size // ALIGN) * ALIGN
    return out, max(at, ALIGN)


class Region:
    """One shared buffer on one device (a memfd on CPU, a CUDA allocation on GPU) and its handle."""

    def __init__(self, flat: Any, handle: dict, closer=None):
        self.flat, self.handle, self._closer = flat, handle, closer

    @classmethod
    def create(cls, nbytes: int, device: str, name: str) -> "Region":
        import torch

        if device.startswith("cuda"):
            from torch.multiprocessing.reductions import reduce_tensor

            flat = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            _, args = reduce_tensor(flat)
            handle = {"kind": "cuda", "nbytes": nbytes, "args": base64.b64encode(pickle.dumps(args)).decode()}
            return cls(flat, handle)
        if not hasattr(os, "memfd_create"):
            raise WeightSyncError(f"a CPU weight handoff needs memfd_create (Linux); set {ENV}=0 for the broadcast")
        nonce = secrets.token_hex(8)
        fd = os.memfd_create(f"{name}-{nonce}", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        handle = {"kind": "memfd", "nbytes": nbytes, "pid": os.getpid(), "fd": fd, "name": f"{name}-{nonce}"}
        return cls(flat, handle, closer=(mm, fd))

    @classmethod
    def open(cls, handle: dict, device: str) -> "Region":
        """The subscriber's view of the publisher's region (raises WeightSyncError if it is not there)."""
        import torch

        if handle.get("kind") == "cuda":
            if not device.startswith("cuda"):
                raise WeightSyncError(f"the publisher handed a CUDA region to a subscriber on {device!r}")
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            args = _TorchOnly(io.BytesIO(base64.b64decode(handle["args"]))).load()
            flat = rebuild_cuda_tensor(*args)
            return cls(flat.view(-1)[:handle["nbytes"]], handle)
        if handle.get("kind") != "memfd":
            raise WeightSyncError(f"unknown weight handoff region kind {handle.get('kind')!r}")
        path = f"/proc/{int(handle['pid'])}/fd/{int(handle['fd'])}"
        try:
            target = os.readlink(path)
            if target != f"/memfd:{handle['name']} (deleted)":  # the publisher closed it; the number was reused
                raise WeightSyncError(f"{path} is {target!r}, not the region {handle['name']!r}")
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise WeightSyncError(f"cannot open the publisher's weight region {handle['name']!r} at {path}: {e} "
                                  f"(the publisher is gone, or /proc is not readable here: set {ENV}=0 in the "
                                  "controller's environment to use the broadcast)") from e
        try:
            if os.fstat(fd).st_size != handle["nbytes"]:
                raise WeightSyncError(f"the weight region {handle['name']!r} has {os.fstat(fd).st_size} bytes, "
                                      f"the offer says {handle['nbytes']}")
            mm = mmap.mmap(fd, handle["nbytes"], access=mmap.ACCESS_READ)  # holds a descriptor of its own
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only on purpose: the subscriber never writes the publisher's buffer
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mm, dtype=torch.uint8)
        return cls(flat, handle, closer=(mm, None))

    def buckets(self, plan: BucketPlan) -> list:
        """The plan's buckets as views into the region."""
        import torch

        offsets, total = plan_offsets(plan)
        if total > self.flat.numel():
            raise WeightSyncError(f"the weight region has {self.flat.numel()} bytes; the layout needs {total}")
        return [self.flat[o:o + n].view(getattr(torch, dtype)) for (o, n), (dtype, _, _) in zip(offsets, plan.buckets)]

    def close(self) -> None:
        """Let go of the region (every view of it must be dropped first)."""
        self.flat = None
        if self._closer is not None:
            mm, fd = self._closer
            self._closer = None
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
                mm.close()
            if fd is not None:
                os.close(fd)


class _TorchOnly(pickle.Unpickler):
    """A CUDA IPC handle's arguments: tensor and storage classes, dtypes, sizes and bytes, nothing else."""

    def find_class(self, module: str, name: str):
        if module == "torch" or module.startswith("torch.") and not module.startswith("torch.multiprocessing"):
            return super().find_class(module, name)
        raise WeightSyncError(f"the weight handoff's handle names {module}.{name}; only torch types are accepted")


def _wait_done(store, r: int, world_size: int, deadline: float, stop) -> dict[int, str]:
    """The publisher: every subscriber's verdict on round r ("ok" or "failed: WHY")."""
    verdicts = {}
    for rank in range(1, world_size):
        key = f"round-{r}/done/{rank}"
        if not wait_until(lambda: store.check([key]), deadline, stop, block=blocking(store, [key])):
            raise WeightSyncError(f"rank {rank} did not say the handed-off version landed before the deadline "
                                  "(ready_timeout_s + timeout_s); the region stays locked no longer")
        verdicts[rank] = store.get(key).decode()
    return verdicts


class SharedPublisher(WeightPublisher):
    """A WeightPublisher that also hands versions off to subscribers on its own device."""

    def __init__(self, *args, region_name: str = "flowrl-weights", **kwargs):
        super().__init__(*args, **kwargs)
        self.region_name = region_name
        self.region: Region | None = None  # made at the first handoff: the send buckets move into it

    def shared(self) -> Region:
        """The region, made once: the send buckets (and the snapshot they hold) move into it."""
        if self.region is None:
            with self._lock:
                region = Region.create(plan_offsets(self.plan)[1], self.device, self.region_name)
                views = region.buckets(self.plan)
                for old, new in zip(self.buckets, views):
                    new.copy_(old)
                self.buckets, self.region = views, region
        return self.region

    def serve(self, epoch: int, world_size: int, *, timeout_s: float = 30.0, ready_timeout_s: float = 60.0,
              handoff: bool = False) -> int:
        """`handoff=False`: the broadcast (WeightPublisher.serve). Else one handoff round of `epoch`,
        with the broadcast's refusals (a stale or failed epoch) and handshake; returns the version."""
        if not handoff:
            return super().serve(epoch, world_size, timeout_s=timeout_s, ready_timeout_s=ready_timeout_s)
        store, r = self._open_round(epoch, world_size)
        if world_size < 2:
            return self.version
        stop = lambda: self._stale(epoch)  # noqa: E731
        try:
            try:
                region = self.shared()
                gather(store, r, world_size, ready_timeout_s, stop=stop)
            except WeightSyncError as e:
                release(store, r, f"abort: {e}")
                raise WeightSyncError(f"weight-sync epoch {epoch} round {r}: {e}") from e
            if r > 0:
                forget(store, r - 1, world_size)
                for key in ["offer", *(f"done/{k}" for k in range(1, world_size))]:
                    store.delete_key(f"round-{r - 1}/{key}")
            with self._lock:  # no snapshot writes the region until every subscriber is done with it
                t0 = time.perf_counter()
                if self.device.startswith("cuda"):
                    import torch

                    torch.cuda.current_stream(self.device).synchronize()  # the snapshot's copies are in
                sent = self.version  # what this round hands over (a snapshot may follow once the lock is free)
                store.set(f"round-{r}/offer", json.dumps({"version": sent, "layout": self.layout_digest,
                                                          "region": region.handle}))
                release(store, r, "go")
                verdicts = _wait_done(store, r, world_size, time.monotonic() + ready_timeout_s + timeout_s, stop)
                self.seconds = time.perf_counter() - t0
            failed = {k: v for k, v in verdicts.items() if v != "ok"}
            if failed:  # the subscriber reports its own failure; the epoch is not the publisher's to end
                log.info("handoff of version %s: %s", sent, failed)
            return sent
        except Exception:
            self._failed = True
            raise

    def close(self) -> None:
        super().close()
        if self.region is not None:
            self.buckets = []
            self.region.close()
            self.region = None


class SharedSubscriber(WeightSubscriber):
    """A WeightSubscriber that also takes versions handed off by a publisher on its own device."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handoff = False
        self.zero_copy = self.mode in ("copy", "loader")  # staging can be the region (swap points into staging)
        self._region: Region | None = None
        self._held_round: int | None = None  # the round whose region is mapped (until `finish`)

    def join(self, epoch: int, rank: int, world_size: int, store_addr, secret, timeout_s: float = 30.0, *,
             ready_timeout_s: float = 60.0, handoff: bool = False) -> None:
        super().join(epoch, rank, world_size, store_addr, secret, timeout_s, ready_timeout_s=ready_timeout_s)
        self.handoff = handoff
        # a node that applies adapter versions itself reads them after the commit: they need a buffer
        # of our own (a few MB), not the region, which is let go at the commit
        self.zero_copy = self.mode in ("copy", "loader") and not (self.adapters and not self.apply_adapters)
        if handoff and self.zero_copy:
            self.staging = []  # no buffer of our own: the region is the staging buffer, for a round
        elif not self.staging and self.plan is not None:
            self._allocate(self.plan.layout)  # what travels: our layout, or the publisher's adapters

    @property
    def nbytes(self) -> int:
        return plan_offsets(self.plan)[1] if self.plan is not None else 0

    def receive(self, commit: bool = True) -> int:
        if not self.handoff:
            return super().receive(commit)
        if self._epoch is None or self._failed:
            raise WeightSyncError("receive() needs a joined epoch that has not failed: call join() with a new epoch")
        r, epoch = self._round, self._epoch
        self._round += 1
        t0 = time.perf_counter()
        try:
            announce(self._store, r, self._rank)
            await_release(self._store, r, self.ready_timeout_s, stop=lambda: self._stale(epoch))
            self._held_round = r  # from here on the publisher waits for our verdict
            offer = json.loads(self._store.get(f"round-{r}/offer"))
            wire = self.plan.layout  # what travels: our own layout, or the publisher's adapters (LoRA)
            if offer.get("layout") != layout_digest(wire):
                raise WeightSyncError(f"the offer's layout digest {offer.get('layout')} is not ours "
                                      f"({layout_digest(wire)})")
            self._staging_holds_version = False
            self._region = Region.open(offer["region"], self.device)
            views = self._region.buckets(self.plan)
            if self.zero_copy:
                self.staging = views
            else:
                for mine, theirs in zip(self.staging, views):
                    mine.copy_(theirs)
                del views
                self.finish()
            for i in range(len(self.plan)):
                if self.fault_hook is not None:
                    self.fault_hook(i)
            version = int(offer["version"])
        except Exception as e:
            self._failed = True
            self.finish(f"failed: {e}")
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"weight handoff epoch {epoch} round {r} failed: {e}") from e
        self.seconds = time.perf_counter() - t0
        if commit:
            self.commit(version)
        return version

    def commit(self, version: int) -> None:
        try:
            super().commit(version)
        except BaseException as e:
            self.finish(f"failed: {e}")
            raise
        self.finish()

    def finish(self, verdict: str = "ok") -> None:
        """The round's region is let go and the publisher told (a no-op when none is held)."""
        if self._held_round is None:
            return
        r, self._held_round = self._held_round, None
        if self._region is not None:
            if self.device.startswith("cuda"):
                import torch

                torch.cuda.current_stream(self.device).synchronize()  # our reads of the region are done
            if self.zero_copy:
                self.staging = []
            self._region.close()
            self._region = None
        with contextlib.suppress(Exception):  # a dead store: the publisher is gone too
            self._store.set(f"round-{r}/done/{self._rank}", verdict[:2000])

    def close(self) -> None:
        self.finish("failed: the subscriber closed")
        super().close()
