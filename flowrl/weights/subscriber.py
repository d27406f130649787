"""A rollout's side of weight sync: whole versions only, label and content always agree.

    sub = WeightSubscriber(model, device="cpu", bucket_bytes=32 << 20)        # swap: no copy
    sub = WeightSubscriber(model.state_dict(), device="cpu")                  # copy into tensors
    # or, for an engine that takes weights through its own API (vLLM):
    sub = WeightSubscriber(lambda named, version: engine.load_weights(named), device="cuda")

    # on a sync order (epoch e, rank k of n), handled between two batches:
    sub.join(e, k, n, store_addr, secret, timeout_s=30, ready_timeout_s=process_timeout_s)
    version = sub.receive()            # raises WeightSyncError: still on sub.version, untouched

`join` checks the layout against the publisher's before any byte moves (LayoutMismatchError names
the first differing tensor, shape and dtype on each side) and is a no-op for the current epoch.
`receive` says it is ready, waits for the publisher's go, then receives every bucket (the last
one carries the version) into *staging* buffers; only when all arrived does the model change and
`sub.version` advance. A broadcast that breaks mid-way leaves the model as it was. Three targets:

- an `nn.Module` (swap, the fast path): a double buffer. The module's parameters and buffers
  are pointed (`t.data = view`) into one bucket set, the next version arrives in the other, and
  a complete version is taken by pointing them at it: no copy after the broadcast. Memory: one
  more copy of the weights. Storage moves at every version, so whatever captured the old
  pointers (a CUDA graph, a fused weight cache) must be rebuilt after `receive` (the node's
  `load_weights` hook).
- a dict of live tensors (copy): the complete version is copied into them (memcpy speed, see
  benchmarks/weight_sync.py). Memory: one more copy of the weights (staging).
- a loader `load(named_tensors, version)`: handed views into staging, in bucket order, each
  tensor once per version; it must copy what it keeps (the next receive overwrites staging).
  If the loader raises, the version does not advance and the error says the engine may hold
  part of it.

Adapter versions (LoRA, see `adapters`): a publisher that sends only `P.lora_A` / `P.lora_B` has
a layout of its own. `join` adopts it when every adapter fits a weight the target holds (else
LayoutMismatchError naming the tensor) and receives into adapter-sized buckets; a full publisher
must still match exactly. On `commit` an adapter version is applied to the target's tensors here
(`W = base + B @ A`, base copies of the adapted tensors only, whole or not at all) -- or, with
`apply_adapters=False`, left for the target to apply: `received()` hands the adapter tensors on
(an engine that merges them into weights of its own, vLLM). `digest()` is then the digest of the
adapter version held, equal to the publisher's.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator

from flowrl.weights.adapters import AdaptedWeights, adapter_mismatch, is_adapter_version
from flowrl.weights.buckets import BucketPlan
from flowrl.weights.errors import LayoutMismatchError, WeightSyncError
from flowrl.weights.group import WeightGroup, local_address
from flowrl.weights.handshake import announce, await_release, verdict
from flowrl.weights.layout import Layout, layout_mismatch, layout_of, weights_digest
from flowrl.weights.store import SealedStore, connect

Loader = Callable[[Iterator[tuple[str, Any]], int], None]


class WeightSubscriber:
    fault_hook: Callable[[int], None] | None = None
    """Tests: called with i once bucket i has arrived."""

    def __init__(self, target: Any, *, device: str = "cpu", bucket_bytes: int = 32 << 20,
                 layout: Layout | None = None, version: int = -1, apply_adapters: bool = True):
        """`target`: an nn.Module (swap), the live tensors (name -> tensor, copy), or a loader
        `load(named_tensors, version)`. A loader without `layout` takes the publisher's layout as
        it is (the engine's own loader rejects names it does not know). `version`: the label of
        the weights the target holds now. `apply_adapters`: apply adapter versions to the target's
        tensors here (True), or hand them on through `received()` for the target to apply."""
        import torch

        self.device, self.bucket_bytes, self.version = device, bucket_bytes, version
        self.mode = "swap" if isinstance(target, torch.nn.Module) else "copy" if isinstance(target, dict) else "loader"
        # swap: the module's own tensor objects (keep_vars), so that repointing them reaches the module
        self.live = target.state_dict(keep_vars=True) if self.mode == "swap" else target if self.mode == "copy" else None
        self.load = target if self.mode == "loader" else None
        self.layout = layout_of(self.live) if self.live is not None else layout
        self.plan: BucketPlan | None = None  # what travels: our layout, or the publisher's adapter layout
        self.staging: list = []
        self.apply_adapters, self.adapters = apply_adapters, False  # adapters: the publisher sends adapter versions
        self.adapted = AdaptedWeights()  # base copies of the tensors adapter versions changed here
        if self.layout is not None:
            self._allocate(self.layout)
        self._live_plan = self.plan  # swap: how the module's tensors lie in their buffers
        self._swap_views: list[tuple[list, list]] = []  # swap: (buffer set, its views by name)
        if self.mode == "swap":
            elsewhere = [n for n, t in self.live.items() if t.device != torch.device(device)]
            if elsewhere:
                raise ValueError(f"tensor {elsewhere[0]!r} of the module is on {self.live[elsewhere[0]].device}, not on "
                                 f"device={device!r}: pass the device the module lives on")
            self._serving = self.plan.allocate(device)
            self.plan.pack(self.live, out=self._serving)
            self._point_live_at(self._serving)
        self._store: SealedStore | None = None
        self._group: WeightGroup | None = None
        self._epoch = self._rank = self._world = None
        self._round, self._failed, self._staging_holds_version = 0, False, False
        self._announced: tuple[int, int] | None = None  # (epoch, round) said ready for ahead of its receive
        self._fence = 0  # epochs below this are stale (see fence)
        self.local_host: str | None = None  # this host's cluster address for gloo (default: the one that reaches the store)
        self.seconds = self.commit_seconds = 0.0  # the last broadcast's and the last copy-out's durations

    def _allocate(self, layout: Layout) -> None:
        self.plan = BucketPlan(layout, self.bucket_bytes)
        self.staging = self.plan.allocate(self.device)

    def join(self, epoch: int, rank: int, world_size: int, store_addr: tuple[str, int], secret: bytes | str,
             timeout_s: float = 30.0, *, ready_timeout_s: float = 60.0) -> None:
        """Enter `epoch` as `rank`; checks the publisher's layout. A no-op for the current epoch."""
        if epoch == self._epoch and not self._failed:
            return
        if self._stale(epoch) or epoch == self._epoch:  # fencing: an order from before a newer epoch
            raise WeightSyncError(self._stale(epoch) or f"weight-sync epoch {epoch} failed here already; "
                                  "the controller must form a newer one")
        self._close_group()
        self._epoch, self._rank, self._world, self._round, self._failed = epoch, rank, world_size, 0, False
        self.timeout_s, self.ready_timeout_s, self._store_host = timeout_s, ready_timeout_s, store_addr[0]
        try:
            # it exists before any order names it, unless its process died since: a newer epoch's order fences the wait
            store = connect(tuple(store_addr), secret, timeout_s=timeout_s, stop=lambda: self._stale(epoch))
            self._store = store.child(f"epoch-{epoch}")
            theirs = [(n, list(s), d) for n, s, d in json.loads(store.get("layout"))]
        except Exception as e:  # noqa: BLE001
            self._failed = True
            raise WeightSyncError(f"cannot join weight-sync epoch {epoch} at {store_addr[0]}:{store_addr[1]}: {e}") from e
        if self.layout is None:
            self.layout = theirs
            self._allocate(theirs)
        problem = self._adopt(theirs)
        if problem:
            self._failed = True
            announce(self._store, 0, rank, f"refused: {problem}")  # the publisher fails at once, naming it
            raise LayoutMismatchError(f"weight layout differs from the publisher's: {problem}")

    def _adopt(self, theirs: Layout) -> str | None:
        """Receive the publisher's adapter layout when it sends adapters that fit our weights, else
        our own layout, which must equal its; returns what is wrong, or None."""
        try:
            adapters = is_adapter_version(n for n, _, _ in theirs) and not is_adapter_version(
                n for n, _, _ in self.layout)
        except ValueError as e:
            return f"{e} (the publisher's layout)"
        problem = adapter_mismatch(theirs, self.layout) if adapters else layout_mismatch(theirs, self.layout)
        wire = [(n, list(s), d) for n, s, d in (theirs if adapters else self.layout)]
        if problem is None and wire != self.plan.layout:
            self._allocate(wire)  # a swap module keeps its own buffers (_serving, _live_plan)
            self._staging_holds_version = False
        self.adapters = adapters and problem is None
        return problem

    def receive(self, commit: bool = True) -> int:
        """Receive the publisher's next broadcast of this epoch; returns the version now held.
        `commit=False`: the version waits in the staging buffers until `commit(version)` makes it the
        live one (on the thread that generates with it, between two of its steps)."""
        if self._epoch is None or self._failed:
            raise WeightSyncError("receive() needs a joined epoch that has not failed: call join() with a new epoch")
        r = self._round
        self._round += 1
        try:
            epoch = self._epoch
            stop = lambda: self._stale(epoch)  # noqa: E731
            # said ready ahead, the group formed, and the one member the publisher waits for: its go can
            # be late for nobody else, so the receive is posted without waiting for it. A round the
            # publisher refuses instead shuts its connections down: the receive fails at once.
            early = self._announced == (epoch, r) and self._group is not None and self._world == 2
            if self._announced != (epoch, r):
                announce(self._store, r, self._rank)
            if not early:
                await_release(self._store, r, self.ready_timeout_s, stop=stop)
            if self._group is None:
                self._group = WeightGroup.join(epoch=epoch, rank=self._rank, world_size=self._world,
                                               store=self._store.child("pg", stop=stop, timeout_s=self.timeout_s),
                                               timeout_s=self.timeout_s,
                                               device=self.device, host=self.local_host or local_address(self._store_host),
                                               stop=stop)  # a forming left behind uses this epoch's client, which a failed epoch drops
            self._staging_holds_version = False
            slot = self.plan.version_slot(self.staging)
            slot.fill_(-1)
            try:
                self.seconds = self._group.broadcast(self.staging, on_bucket=self.fault_hook)
            except WeightSyncError as e:
                if early:
                    raise WeightSyncError(f"{e} ({verdict(self._store, r)})") from e
                raise
            version = int(slot[0])
            if version < 0:
                raise WeightSyncError(f"the version slot says {version}: the broadcast did not complete")
        except Exception as e:
            self._failed = True
            self._close_group()
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"weight sync epoch {self._epoch} round {r} failed: {e}") from e
        if commit:
            self.commit(version)
        return version

    def announce_ahead(self) -> bool:
        """Say ready for the next round of this epoch now, before its `receive` (which then does not
        say it again): the publisher's ready wait finds it when the round is ordered, instead of waiting
        for this member's order to arrive, its receive to start and the store to tell. Only for a
        subscriber whose every next round of the epoch is received as its order arrives, with the
        staging buffers free (a worker's `FetchLane`, once its last round landed): the publisher's
        broadcast may start at once, and its timeout counts from there. Returns whether it said so."""
        store, epoch, r = self._store, self._epoch, self._round
        if epoch is None or self._failed or store is None or getattr(self, "handoff", False):
            return False
        if self._announced != (epoch, r):
            announce(store, r, self._rank)
            self._announced = (epoch, r)
        return True

    def commit(self, version: int) -> None:
        """Make the version `receive(commit=False)` staged the live one."""
        # every bucket (the version in the last) arrived: only now do the live weights change
        t0 = time.perf_counter()
        if self.adapters and self.mode != "loader":
            if self.apply_adapters:
                try:
                    self.adapted.apply(self.live, self.plan.views(self.staging))
                except (KeyError, ValueError) as e:
                    raise WeightSyncError(f"adapter version {version} does not apply (the weights are still "
                                          f"version {self.version}, untouched): {e}") from e
        elif self.mode == "swap":
            self._point_live_at(self.staging)
            self._serving, self.staging = self.staging, self._serving
            self.adapted = AdaptedWeights()  # a full version: what the module holds is its base
        elif self.mode == "copy":
            for i in range(len(self.plan)):
                self.plan.unpack(i, self.staging, self.live)
            self.adapted = AdaptedWeights()
        else:
            try:
                self.load(self.plan.iter_views(self.staging), version)
            except Exception as e:  # noqa: BLE001
                raise WeightSyncError(f"the loader failed on version {version} (still labelled {self.version}); "
                                      f"the engine may hold part of it and should be reloaded: {e}") from e
        self._staging_holds_version = True
        self.version = version
        self.commit_seconds = time.perf_counter() - t0

    def received(self) -> dict[str, Any]:
        """What the node's `load_weights` gets once a version is committed: the live tensors (a full
        version, or an adapter version applied here), the adapter tensors of the version (views into
        staging, valid until the next receive) when the target applies them itself, or {} (a
        loader had them)."""
        if self.adapters and self.mode != "loader" and not self.apply_adapters:
            return self.plan.views(self.staging)
        return self.live if self.live is not None else {}

    def fence(self, epoch: int) -> None:
        """Orders of epochs below `epoch` are stale from now on (any thread may call this): a
        receive of one stops waiting for the go, or for the group to form, within
        handshake.SLICE_S; a broadcast already under way ends within its timeout_s."""
        self._fence = max(self._fence, epoch)

    def _stale(self, epoch: int) -> str | None:
        newest = max(self._fence, self._epoch if self._epoch is not None else 0)
        if epoch < newest:
            return f"weight-sync epoch {epoch} is stale: this subscriber is at epoch {newest}"
        return None

    def _point_live_at(self, buckets: list) -> None:
        """Swap: the module's tensors now lie in `buckets` (one of the two sets it alternates
        between). The views are made once per set and kept while the set is one of the two: 29 new
        views a version were most of a small model's commit (~0.09 ms of its ~0.1)."""
        import torch

        views = next((v for b, v in self._swap_views if b is buckets), None)
        if views is None:  # kept for the sets in use only: a set made anew (`_adopt`) lets the old go
            views = list(self._live_plan.iter_views(buckets))
            self._swap_views = [(b, v) for b, v in self._swap_views if b is self.staging or b is self._serving]
            self._swap_views.append((buckets, views))
        with torch.no_grad():
            for name, view in views:
                self.live[name].data = view

    def digest(self) -> str:
        """Digest of the weights this subscriber serves (equal digests = bitwise equal); of an
        adapter version: of its adapter tensors, as the publisher's."""
        if self.live is not None and not self.adapters:
            return weights_digest(self.live, self.layout)
        if not self._staging_holds_version:
            raise WeightSyncError("no complete version in staging to digest")
        return weights_digest(self.plan.views(self.staging), self.plan.layout)

    def close(self) -> None:
        self._close_group()
        self._store = None

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
