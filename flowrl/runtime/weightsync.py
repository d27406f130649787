"""A node process's side of weight sync: the trainer publishes, subscribers receive whole versions.

The controller forms a weight-sync epoch (a fresh torch.distributed group of the publisher and
every live subscriber) at start, after a member restarts and after a rollback, and orders a
broadcast after every `published`. The worker calls `sync(order)` between two batches, never
during `process`.

    client = WeightsClient(node, publisher=True, device="cpu", recorder=rec, faults=faults)
    client.snapshot(version)                     # publisher, after each update
    version = await client.sync(order)           # both sides; raises WeightSyncError
"""

from __future__ import annotations

import os

import anyio


class WeightsClient:
    bucket_bytes = 32 << 20

    def __init__(self, node, *, publisher: bool, device: str, recorder, faults):
        self.node, self.publisher, self.device = node, publisher, device
        self.recorder, self.faults = recorder, faults
        self.plan = None
        self.buckets = None
        self.live = None
        self.staged = None
        self.group = None
        self.store = None
        self.version_tensor = None
        if publisher:
            from flowrl.weights import host_store

            self.store = host_store()

    @property
    def store_port(self) -> int | None:
        return getattr(self.store, "port", None)

    def snapshot(self, version: int) -> None:
        """Publishers: copy the weights into the send buckets, so training can go on meanwhile."""
        from flowrl.weights import BucketPlan, layout_of

        tensors = self.node.weights()
        if self.plan is None:
            self.plan = BucketPlan(layout_of(tensors), self.bucket_bytes)
            self.buckets = self.plan.allocate(self.device)
        with self.recorder.span("weight_snapshot"):
            self.plan.pack(tensors, out=self.buckets)
        self.version_tensor = self._version_tensor(version)

    def _version_tensor(self, version: int):
        """Travels first in every broadcast: the version the buckets really hold (a newer snapshot
        may have replaced the one a sync order was issued for), so label and content agree."""
        import torch

        return torch.tensor([version], dtype=torch.int64, device=self.device)

    def digest(self) -> dict:
        """With FLOWRL_WEIGHT_DIGEST=1: a digest of the weights this process now holds."""
        if os.environ.get("FLOWRL_WEIGHT_DIGEST") != "1" or self.plan is None:
            return {}
        from flowrl.weights import weights_digest

        tensors = self.plan.views(self.buckets) if self.publisher else self.live
        return {"digest": weights_digest(tensors, self.plan.layout)}

    def abort(self, sync_epoch: int) -> None:
        """A newer epoch was ordered: break a broadcast stuck waiting for a dead member."""
        if self.group is not None and sync_epoch > self.group.epoch:
            self.group.abort()

    def close(self) -> None:
        if self.group:
            self.group.close()
            self.group = None

    async def sync(self, order, version: int) -> int:
        """Join `order.sync_epoch` and broadcast (publisher) or receive (subscriber) one version.

        Subscribers receive into staging buffers and copy into the live weights only once every
        bucket has arrived: a failed broadcast leaves the previous version whole."""
        from flowrl.weights import BucketPlan, WeightGroup, layout_digest, layout_of

        if self.publisher and self.plan is None:
            self.snapshot(version)
        if not self.publisher and self.plan is None:
            live = self.node.weights()
            self.plan = BucketPlan(layout_of(live), self.bucket_bytes)
            self.buckets = self.plan.allocate(self.device)  # staging: never the live tensors
            self.live = live
        try:
            with self.recorder.span("weight_sync", version=order.version):
                if self.group is None or self.group.epoch != order.sync_epoch:
                    self.close()
                    store = self.store if self.publisher else tuple(order.store)
                    self.group = await anyio.to_thread.run_sync(lambda: WeightGroup.join(
                        epoch=order.sync_epoch, rank=order.rank, world_size=order.world_size, store=store,
                        timeout_s=order.timeout_s, device=self.device))
                    await anyio.to_thread.run_sync(self.group.check_layout, layout_digest(self.plan.layout))
                if self.faults.fail_sync(order.version):
                    raise RuntimeError("injected weight-sync failure")
                if not self.publisher:
                    self.version_tensor = self._version_tensor(-1)
                tensors = [self.version_tensor, *self.buckets]
                seconds = await anyio.to_thread.run_sync(lambda: self.group.broadcast(tensors))
                nbytes = sum(b.numel() * b.element_size() for b in self.buckets)
                self.recorder.count("weight_sync_bytes", nbytes, per_node=True)
                self.recorder.observe("weight_sync_s", seconds, per_node=True)
        except Exception:
            self.close()
            raise
        received = int(self.version_tensor[0])
        if not self.publisher:
            for i in range(len(self.plan)):  # every bucket arrived: now the live weights change
                self.plan.drain(i, self.buckets, self.live)
            self.node.load_weights(self.live, received)
        return received
