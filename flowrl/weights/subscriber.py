"""A rollout's side of weight sync: whole versions only, label and content always agree.

    sub = WeightSubscriber(model.state_dict(), device="cpu", bucket_bytes=32 << 20)
    # or, for an engine that takes weights through its own API (vLLM):
    sub = WeightSubscriber(lambda named, version: engine.load_weights(named), device="cuda")

    # on a sync order (epoch e, rank k of n), handled between two batches:
    sub.join(e, k, n, store_addr, secret, timeout_s=30, ready_timeout_s=process_timeout_s)
    version = sub.receive()            # raises WeightSyncError: still on sub.version, untouched

`join` checks the layout against the publisher's before any byte moves (LayoutMismatchError names
the first differing tensor, shape and dtype on each side) and is a no-op for the current epoch.
`receive` says it is ready, waits for the publisher's go, then receives the version tensor and
every bucket into *staging* buffers; only when all arrived is the version copied into the live
tensors (or handed to the loader) and `sub.version` set. A broadcast that breaks mid-way leaves
the live tensors as they were. Cost: staging holds one more copy of the weights (serving dtype)
for the subscriber's lifetime, and each version is copied once more after it has arrived (memcpy
speed; see benchmarks/weight_sync.py). A loader is handed views into staging, in layout order,
each tensor once per version; it must copy what it keeps (the next receive overwrites staging).
If the loader itself raises, the version is not advanced and the error says the engine may hold
a partial version.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

from flowrl.weights.buckets import BucketPlan
from flowrl.weights.errors import LayoutMismatchError, WeightSyncError
from flowrl.weights.group import WeightGroup, local_address
from flowrl.weights.handshake import announce, await_release
from flowrl.weights.layout import Layout, layout_mismatch, layout_of, weights_digest
from flowrl.weights.store import SealedStore, connect

Loader = Callable[[Iterator[tuple[str, Any]], int], None]


class WeightSubscriber:
    fault_hook: Callable[[int], None] | None = None
    """Tests: called with i once tensor i has arrived (0 is the version tensor)."""

    def __init__(self, target: dict[str, Any] | Loader, *, device: str = "cpu", bucket_bytes: int = 32 << 20,
                 layout: Layout | None = None, version: int = -1):
        """`target`: the live tensors (name -> tensor, e.g. a state_dict), or a loader
        `load(named_tensors, version)`. A loader without `layout` takes the publisher's layout as
        it is (the engine's own loader rejects names it does not know)."""
        import torch

        self.device, self.bucket_bytes, self.version = device, bucket_bytes, version
        self.live = target if isinstance(target, dict) else None
        self.load = None if isinstance(target, dict) else target
        self.layout = layout_of(target) if self.live is not None else layout
        self.plan: BucketPlan | None = None
        self.staging: list = []
        if self.layout is not None:
            self._allocate(self.layout)
        self._version_tensor = torch.zeros(1, dtype=torch.int64, device=device)
        self._store: SealedStore | None = None
        self._group: WeightGroup | None = None
        self._epoch = self._rank = self._world = None
        self._round, self._failed, self._staging_holds_version = 0, False, False

    def _allocate(self, layout: Layout) -> None:
        self.plan = BucketPlan(layout, self.bucket_bytes)
        self.staging = self.plan.allocate(self.device)

    def join(self, epoch: int, rank: int, world_size: int, store_addr: tuple[str, int], secret: bytes | str,
             timeout_s: float = 30.0, *, ready_timeout_s: float = 60.0) -> None:
        """Enter `epoch` as `rank`; checks the publisher's layout. A no-op for the current epoch."""
        if epoch == self._epoch and not self._failed:
            return
        self._close_group()
        self._epoch, self._rank, self._world, self._round, self._failed = epoch, rank, world_size, 0, False
        self.timeout_s, self.ready_timeout_s, self._store_host = timeout_s, ready_timeout_s, store_addr[0]
        try:
            store = connect(tuple(store_addr), secret, timeout_s=ready_timeout_s)
            self._store = store.child(f"epoch-{epoch}")
            theirs = [(n, list(s), d) for n, s, d in json.loads(store.get("layout"))]
        except Exception as e:  # noqa: BLE001
            self._failed = True
            raise WeightSyncError(f"cannot join weight-sync epoch {epoch} at {store_addr[0]}:{store_addr[1]}: {e}") from e
        if self.layout is None:
            self.layout = theirs
            self._allocate(theirs)
        problem = layout_mismatch(theirs, self.layout)
        if problem:
            self._failed = True
            announce(self._store, 0, rank, f"refused: {problem}")  # the publisher fails at once, naming it
            raise LayoutMismatchError(f"weight layout differs from the publisher's: {problem}")

    def receive(self) -> int:
        """Receive the publisher's next broadcast of this epoch; returns the version now held."""
        if self._epoch is None or self._failed:
            raise WeightSyncError("receive() needs a joined epoch that has not failed: call join() with a new epoch")
        r = self._round
        self._round += 1
        try:
            announce(self._store, r, self._rank)
            await_release(self._store, r, self.ready_timeout_s)
            if self._group is None:
                self._group = WeightGroup.join(epoch=self._epoch, rank=self._rank, world_size=self._world,
                                               store=self._store.child("pg"), timeout_s=self.timeout_s,
                                               device=self.device, host=local_address(self._store_host))
            self._staging_holds_version = False
            self._version_tensor.fill_(-1)
            self.seconds = self._group.broadcast([self._version_tensor, *self.staging], on_bucket=self.fault_hook)
            version = int(self._version_tensor[0])
            if version < 0:
                raise WeightSyncError(f"the version tensor says {version}: the broadcast did not complete")
        except Exception as e:
            self._failed = True
            self._close_group()
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"weight sync epoch {self._epoch} round {r} failed: {e}") from e
        self._commit(version)
        return version

    def _commit(self, version: int) -> None:
        # every bucket and the version tensor arrived: only now do the live weights change
        if self.live is not None:
            for i in range(len(self.plan)):
                self.plan.unpack(i, self.staging, self.live)
        else:
            try:
                self.load(self.plan.iter_views(self.staging), version)
            except Exception as e:  # noqa: BLE001
                raise WeightSyncError(f"the loader failed on version {version} (still labelled {self.version}); "
                                      f"the engine may hold part of it and should be reloaded: {e}") from e
        self._staging_holds_version = True
        self.version = version

    def digest(self) -> str:
        """Digest of the weights this subscriber serves (equal digests = bitwise equal)."""
        if self.live is not None:
            return weights_digest(self.live, self.layout)
        if not self._staging_holds_version:
            raise WeightSyncError("no complete version in staging to digest")
        return weights_digest(self.plan.views(self.staging), self.layout)

    def close(self) -> None:
        self._close_group()
        self._store = None

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
