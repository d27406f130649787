"""A node process's side of weight sync, on top of `flowrl.weights` (publisher / subscriber).

The controller forms a weight-sync epoch (a fresh torch.distributed group of the publisher and
every live subscriber) at start, after a member restarts and after a rollback, and orders a
broadcast after every `published`. The worker calls `sync(order)` between two calls into the
node (or, with `concurrency`, while calls run: the buffers fill on a thread of their own and the
weights change on the compute thread between two generation steps, `land`); a subscriber's weights
change only when a whole version arrived.

    client = WeightsClient(node, publisher=True, device="cpu", secret=s, serving_dtype="bfloat16", ...)
    client.snapshot(version)                      # publisher, after each update
    version = await client.sync(order, v, runner)  # both sides; raises WeightSyncError

What a subscriber's `weights()` returns decides how a version lands: an `nn.Module` (swapped in,
no copy), a dict of live tensors (copied in once complete), or a callable
`load(named_tensors, version)` (an inference engine's own loader).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os

from flowrl.runtime.worker import blocking

log = logging.getLogger("flowrl.worker")


class WeightsClient:
    bucket_bytes = 32 << 20

    def __init__(self, node, *, publisher: bool, device: str, recorder, faults, secret: str,
                 serving_dtype: str | None = None, ready_timeout_s: float = 600.0, host: str = "127.0.0.1",
                 region_name: str = "flowrl-weights"):
        self.node, self.publisher, self.device = node, publisher, device
        self.recorder, self.faults, self.secret = recorder, faults, secret
        self.serving_dtype = serving_dtype
        self.host = host  # this host's cluster address: the publisher's store and every gloo socket bind here
        self.ready_timeout_s = ready_timeout_s
        self.pub = None
        self.sub = None
        self.fenced = 0  # epochs below this are stale (a subscriber made later starts fenced there)
        self.ordered = 0  # the newest sync epoch ordered
        if publisher:
            from flowrl.weights.handoff import SharedPublisher  # a broadcast, or a handoff on its own device

            self.pub = SharedPublisher(node.weights, device=device, bucket_bytes=self.bucket_bytes,
                                       serving_dtype=None if serving_dtype == "float32" else serving_dtype,
                                       store_host=host, secret=secret, region_name=region_name)
            if os.environ.get("FLOWRL_WEIGHT_DIGEST") == "1":
                self.pub.keep_digests()

    def rebind(self, node) -> None:
        """The node was built anew (a rollback with nothing committed): read and load its weights."""
        self.node = node
        if self.pub is not None:
            self.pub.tensors_fn = node.weights
        if self.sub is not None:
            self.sub.close()
            self.sub = None  # made again, fenced where this one was, on the next sync

    @property
    def store_port(self) -> int | None:
        return self.pub.store_addr[1] if self.pub is not None else None

    def snapshot(self, version: int) -> None:
        """Publishers: copy the weights into the send buckets, so training can go on meanwhile."""
        with self.recorder.span("weight_snapshot"):
            self.pub.snapshot(version)

    def subscriber(self):
        if self.sub is None:
            from flowrl.weights.handoff import SharedSubscriber

            # a node that applies adapter (LoRA) versions itself (the rollout's engines) gets them as
            # they came; any other has them applied to its weights() by the subscriber
            self.sub = SharedSubscriber(self.node.weights(), device=self.device, bucket_bytes=self.bucket_bytes,
                                        version=0, apply_adapters=not getattr(self.node, "applies_adapters", False))
            self.sub.local_host = self.host
            self.sub.fence(self.fenced)
        return self.sub

    def digest(self, version: int) -> dict:
        """With FLOWRL_WEIGHT_DIGEST=1: a digest of `version` as this process holds it (a publisher:
        of its snapshot of `version`, though the buckets may hold a newer one by now)."""
        if os.environ.get("FLOWRL_WEIGHT_DIGEST") != "1":
            return {}
        from flowrl.weights import WeightSyncError

        try:
            return {"digest": self.pub.digest(version) if self.pub is not None else self.sub.digest()}
        except WeightSyncError as e:  # a check's aid: the row goes without a digest, the node goes on
            log.warning("no digest of version %s: %s", version, e)
            return {}

    def fence(self, sync_epoch: int) -> None:
        """A newer epoch was ordered (any thread): stop waiting for the members of an older one."""
        self.ordered = max(self.ordered, sync_epoch)
        self._fence(sync_epoch)

    def rolled_back(self) -> None:
        """A recovery began (any thread): it disbands the weight group and its end forms a newer
        epoch, so no round of an epoch ordered so far can complete (a member is down), and none is
        waited for meanwhile."""
        self._fence(self.ordered + 1)

    def _fence(self, sync_epoch: int) -> None:
        self.fenced = max(self.fenced, sync_epoch)
        for side in (self.pub, self.sub):
            if side is not None:
                side.fence(sync_epoch)

    def close(self) -> None:
        for side in (self.pub, self.sub):
            if side is not None:
                side.close()

    async def sync(self, order, version: int, runner) -> int:
        """Join `order.sync_epoch` and broadcast (publisher) or receive (subscriber) one version, or
        hand it off (`order.handoff`: both on one device, flowrl.weights.handoff). What touches the
        node's weights (a first snapshot, loading a version) runs on the node's compute thread
        (`runner`, runner.py); the broadcast itself on a thread of its own. A subscriber's handoff
        is one turn (take_turns): it says it is ready only once it holds its devices, so the
        trainer never waits for the region while the subscriber waits for the trainer's turn."""
        handoff = order.handoff
        if self.publisher:
            with self.recorder.span("weight_sync", version=order.version, handoff=handoff):
                if self.pub.version is None:
                    await runner.run(self.snapshot, version)
                sent = await blocking.run(lambda: self.pub.serve(
                    order.sync_epoch, order.world_size, timeout_s=order.timeout_s,
                    ready_timeout_s=self.ready_timeout_s, handoff=handoff))
            self._measure(order, self.pub.seconds)
            return sent
        async with runner.turn("weight handoff") if handoff else contextlib.nullcontext():
            try:
                with self.recorder.span("weight_sync", version=order.version, handoff=handoff):
                    received = await self._receive(order, handoff)
                await runner.run(self.land, received)
            finally:  # a handed-off region is let go and the publisher told (a no-op once the version landed)
                if self.sub is not None:
                    self.sub.finish("failed: the version did not land")
        return received

    async def fetch(self, order) -> int:
        """A subscriber's round, received into the staging buffers while the node may be in a call
        (syncs.py, `FetchLane`); `land_fetched` makes it live, between two calls."""
        with self.recorder.span("weight_sync", version=order.version, handoff=False, beside=True):
            return await self._receive(order, False)

    async def land_fetched(self, fetch, runner) -> int:
        """The round `fetch` received (waiting for it to arrive) becomes the live weights."""
        await fetch.done.wait()
        try:
            if fetch.error is not None:
                raise fetch.error
            await runner.run(self.land, fetch.received)
        finally:  # as `sync`: a round that did not land is let go
            if self.sub is not None:
                self.sub.finish("failed: the version did not land")
        return fetch.received

    async def _receive(self, order, handoff: bool) -> int:
        sub = self.subscriber()
        store = (order.store[0], int(order.store[1]))

        def join_and_receive() -> int:  # one thread hop per round (the join is a no-op within an epoch)
            sub.join(order.sync_epoch, order.rank, order.world_size, store, self.secret, timeout_s=order.timeout_s,
                     ready_timeout_s=self.ready_timeout_s, handoff=handoff)
            if self.faults.fail_sync(order.version):
                sub.fault_hook = _fail_after_first_bucket
            try:  # into the staging buffers; the live weights change below, on the compute thread
                return sub.receive(commit=False)
            finally:
                sub.fault_hook = None

        received = await blocking.run(join_and_receive)
        self._measure(order, sub.seconds)
        return received

    def announce_ahead(self) -> None:
        """A plain subscriber whose round landed: ready for the next one (`WeightSubscriber.announce_ahead`;
        on a thread: one store round trip). Best effort: a store that fails here fails the next receive."""
        sub = self.sub
        if sub is not None:
            try:
                sub.announce_ahead()
            except Exception as e:  # noqa: BLE001
                log.debug("could not say ready ahead of the next round: %s", e)

    def _measure(self, order, seconds: float) -> None:
        if order.world_size > 1:  # a publisher alone in its epoch sent nothing (the order only fenced older ones)
            nbytes = self.pub.plan.nbytes(self.pub.buckets) if self.pub is not None else self.sub.nbytes
            self.recorder.count("weight_sync_bytes", nbytes, per_node=True)
            self.recorder.observe("weight_sync_s", seconds, per_node=True)

    async def land(self, version: int) -> None:
        """On the node's compute thread: the staged version becomes the live one. A node generating
        while weights arrive (`concurrency`, a continuous engine) stops between two of its steps first
        (its `before_weights` hook, which may wait for its running sequences: `on_new_weights`); no
        generation step runs from here until `load_weights` returned."""
        hook = getattr(self.node, "before_weights", None)
        if hook is not None:
            with self.recorder.span("weight_pause", version=version):
                await hook(version)
        try:
            self.sub.commit(version)
            loaded = self.node.load_weights(self.sub.received(), version)
            if inspect.isawaitable(loaded):
                await loaded
        except BaseException:
            failed = getattr(self.node, "weights_failed", None)  # whatever before_weights paused goes on
            if hook is not None and failed is not None:
                failed(version)
            raise


def _fail_after_first_bucket(i: int) -> None:
    if i >= 0:
        raise RuntimeError("injected weight-sync failure (fault 'fail_sync') after the first bucket arrived")
