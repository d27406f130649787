"""The trainer's side of weight sync: the plan, the send buckets, the store and the version.

    pub = WeightPublisher(model.state_dict, device="cpu", bucket_bytes=32 << 20,
                          serving_dtype="bfloat16", store_host="127.0.0.1", secret=run_secret)
    # the controller hands pub.store_addr and the run's secret to every subscriber
    pub.snapshot(version=0)                       # the initial weights
    while training:
        train_step()                              # fp32 (or bf16) master weights change
        pub.snapshot(version=pub.version + 1)     # copy out, cast to the serving dtype; training goes on
        # when the controller orders a sync (epoch e, n members incl. us), in a thread:
        sent = pub.serve(epoch=e, world_size=n, timeout_s=30, ready_timeout_s=process_timeout_s)

`serve` sends the newest snapshot, whatever version the order named: the version travels in the
last bucket (`BucketPlan.version_slot`), so what a subscriber labels and what it holds always
agree. A `serve` and a `snapshot` never overlap (a lock): a snapshot taken while a broadcast runs
waits for it; the ready wait (see `handshake`) holds no lock, so training goes on while
subscribers finish their batches. Memory: one copy of the weights in the serving dtype (the send buckets).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

from flowrl.weights.buckets import BucketPlan
from flowrl.weights.errors import WeightSyncError
from flowrl.weights.group import WeightGroup
from flowrl.weights.handshake import forget, gather, release
from flowrl.weights.layout import layout_digest, layout_of, serving_layout, weights_digest
from flowrl.weights.store import WeightStore, connect


class WeightPublisher:
    fault_hook: Callable[[int], None] | None = None
    """Tests: called with i just before bucket i goes out."""

    def __init__(self, tensors_fn: Callable[[], dict[str, Any]], *, device: str = "cpu",
                 bucket_bytes: int = 32 << 20, serving_dtype: str | None = None,
                 store_host: str = "127.0.0.1", secret: bytes | str):
        self.tensors_fn, self.device = tensors_fn, device
        self.layout = serving_layout(layout_of(tensors_fn()), serving_dtype)
        self.layout_digest = layout_digest(self.layout)
        self.plan = BucketPlan(self.layout, bucket_bytes)
        self.buckets = self.plan.allocate(device)
        self.version: int | None = None  # the version the buckets hold; None before any snapshot
        self.seconds = 0.0  # the last broadcast's duration
        self._server = WeightStore(store_host)
        self._secret = secret
        self._store = self._server.sealed(secret)
        self._store.set("layout", json.dumps(self.layout))
        self._lock = threading.Lock()
        self._group: WeightGroup | None = None
        self._epoch: int | None = None
        self._rounds: dict[int, int] = {}  # epoch -> rounds ordered so far (served or refused)
        self._failed = False
        self._fence = 0  # epochs below this are stale (see fence)
        self.digests: dict[int, str] | None = None  # set to {}: each snapshot's digest, by version (keep_digests)

    @property
    def store_addr(self) -> tuple[str, int]:
        return self._server.address

    def snapshot(self, version: int) -> None:
        """Copy the trainer's current weights into the send buckets (cast to the serving dtype)."""
        tensors = self.tensors_fn()
        with self._lock:
            self.plan.pack(tensors, out=self.buckets)
            self.version = version
            if self.digests is not None:
                self.digests.pop(version, None)  # a rollback takes a number again: it is the newest now
                self.digests[version] = weights_digest(self.plan.views(self.buckets), self.layout)
                while len(self.digests) > 8:  # the 8 snapshots taken last (not the 8 highest numbers)
                    del self.digests[next(iter(self.digests))]

    def keep_digests(self) -> None:
        """Digest every snapshot as it is taken (tests, FLOWRL_WEIGHT_DIGEST): `digest(v)` then
        answers for a version the buckets no longer hold -- the one a round sent while the trainer
        went on to snapshot the next."""
        with self._lock:
            self.digests = {} if self.version is None else \
                {self.version: weights_digest(self.plan.views(self.buckets), self.layout)}

    def serve(self, epoch: int, world_size: int, *, timeout_s: float = 30.0, ready_timeout_s: float = 60.0) -> int:
        """Send the newest snapshot to ranks 1..world_size-1 of `epoch`; returns the version sent.

        Waits up to `ready_timeout_s` for every member to say it is free, then forms the epoch's
        group (first round only) and broadcasts, each within `timeout_s`. Raises WeightSyncError
        naming the member at fault; the epoch is then over (the controller forms a new one).
        Every call is one round of `epoch`, the round its subscribers' `receive` waits on: one this
        refuses (a stale epoch, one that failed) still gets its verdict, `abort: WHY`."""
        store, r = self._open_round(epoch, world_size)
        if world_size < 2:
            return self.version
        stop = lambda: self._stale(epoch)  # noqa: E731
        try:
            try:
                gather(store, r, world_size, ready_timeout_s, stop=stop)
            except WeightSyncError as e:
                release(store, r, f"abort: {e}")
                raise WeightSyncError(f"weight-sync epoch {epoch} round {r}: {e}") from e
            release(store, r, "go")
            with self._lock:  # the collective's timeout counts from here: every member is waiting
                if self._group is None:
                    # forming gets a store client of its own: one left behind when fenced (group.py) may still use it
                    own = connect(self._server.address, self._secret, timeout_s=timeout_s).child(f"epoch-{epoch}")
                    self._group = WeightGroup.join(epoch=epoch, rank=0, world_size=world_size,
                                                   store=own.child("pg", stop=stop, timeout_s=timeout_s),
                                                   timeout_s=timeout_s, device=self.device, host=self._server.host,
                                                   stop=stop)
                sent = self.version  # what this round sends (a snapshot may follow once the lock is free)
                self.plan.version_slot(self.buckets).fill_(sent)  # the label travels with the weights
                self.seconds = self._group.broadcast(self.buckets, fill=self.fault_hook)
            if r > 0:  # everyone is past round r - 1: the store stays O(members), not O(versions) (after
                forget(store, r - 1, world_size)  # the broadcast: the members wait for it, not for this)
            return sent
        except Exception:
            self._failed = True
            self._close_group()
            raise

    def _open_round(self, epoch: int, world_size: int):
        """The next round of `epoch`: its store and number, or a refusal every member hears (a
        stale or failed epoch: WeightSyncError). A new epoch drops the old group."""
        if self.version is None:
            raise ValueError("serve() before any snapshot(): publish the initial weights with snapshot(version=0) first")
        store, r = self._store.child(f"epoch-{epoch}"), self._rounds.get(epoch, 0)
        self._rounds[epoch] = r + 1
        refusal = self._stale(epoch)  # fencing: an order from before a newer epoch
        if refusal is None and epoch == self._epoch and self._failed:
            refusal = f"weight-sync epoch {epoch} already failed; the controller must form a new epoch"
        if refusal:
            if world_size >= 2:
                release(store, r, f"abort: {refusal}")
            if epoch == self._epoch:  # nothing more goes out in this epoch: a receive posted ahead fails now
                self._close_group()
            self._forget_old_rounds()
            raise WeightSyncError(refusal)
        if epoch != self._epoch:
            self._close_group()
            self._epoch, self._failed = epoch, False
            self._forget_old_rounds()
        return store, r

    def fence(self, epoch: int) -> None:
        """Orders of epochs below `epoch` are stale from now on (any thread may call this, e.g. the
        worker when a newer sync order arrives): a serve of one stops waiting for members (the
        ready wait, the forming of the group) within handshake.SLICE_S; a broadcast already under
        way ends within its timeout_s."""
        self._fence = max(self._fence, epoch)

    def _stale(self, epoch: int) -> str | None:
        newest = max(self._fence, self._epoch if self._epoch is not None else 0)
        if epoch < newest:
            return f"weight-sync epoch {epoch} is stale: the publisher is at epoch {newest}"
        return None

    def _forget_old_rounds(self, keep: int = 8) -> None:
        """Round counters of the newest `keep` epochs (an order of an older one is refused anyway)."""
        for e in sorted(self._rounds)[:-keep]:
            del self._rounds[e]

    def digest(self, version: int | None = None) -> str:
        """Digest of the snapshot the buckets hold (equal digests = bitwise equal weights), or of
        `version`'s snapshot, kept since it was taken (`keep_digests`: then no hashing here, nor a
        wait for the lock that a broadcast holds -- the worker asks from its event loop)."""
        kept = self.digests.get(version) if self.digests is not None and version is not None else None
        if kept is not None:
            return kept
        with self._lock:
            if version is None or version == self.version:
                return weights_digest(self.plan.views(self.buckets), self.layout)
            if self.digests is None or version not in self.digests:
                raise WeightSyncError(f"no digest of version {version}: the buckets hold version {self.version} "
                                      "and keep_digests() kept none of it")
            return self.digests[version]

    def close(self) -> None:
        self._close_group()
        self._server.close()

    def _close_group(self) -> None:
        """The group is done with (a new epoch, a failure, the end): its connections are shut down
        too, so a member that posted a receive ahead of a go (`WeightSubscriber.receive`) fails at once."""
        if self._group is not None:
            self._group.break_links()
            self._group.close()
            self._group = None
