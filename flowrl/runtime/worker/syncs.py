"""Weight-sync orders in a node process: a `Sync` order runs one round (`weightsync.py`); then a
subscriber holds the new version and the batches that waited for it go on (the version gate), and
an observer is shown the version.

    syncs.fence(order.sync_epoch)        # from the control loop, as the order arrives
    await syncs.order(order)             # on the event queue, between two calls into the node
    await syncs.join(sync_epoch)         # a data-parallel follower, when its leader's step says so

Every rank of a data-parallel subscriber is a member of the sync group, a collective: the ranks
join it when their leader says (a `GroupStep`), never while another rank waits for them in a step
of its own.

A plain subscriber (one rank, one call at a time, no take-turns group, no handoff) receives a
round beside its call (`FetchLane`): the round starts as the order arrives, the version waits in
the staging buffers, and the order, in its place on the event queue, only lands it (on the compute
thread, between two calls, as before). Waiting for the running call to end first made the
publisher's round and the subscriber's receive a step of their own on the subscriber's path: with
`max_staleness >= 1` a few ms per version of a rollout's time. One round is fetched at a time, and
the next only once the last landed (they share the staging buffers). Some rounds still run whole
in their order's turn (`FetchLane.start`: a handoff, a subscriber's first, one queued behind a
rollback, which may make the subscriber anew), and no round is fetched while one of those waits
or runs: one ordered behind them is fetched once they ran.

A publisher (a trainer) serves its orders beside its calls, on a lane of their own (`serve_lane`),
not between them: a broadcast reads only the send buckets of the last snapshot (the publisher's
lock keeps a snapshot and a broadcast apart), so training on the next batch goes on while the
subscribers take the last version. Queued on the event queue instead, a sync ordered while the
trainer computes would wait for that call, and the subscribers waiting in it would idle: with
`max_staleness >= 1` that was a whole training step lost per version.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from flowrl.runtime.protocol import messages as m
from flowrl.runtime.worker import blocking
from flowrl.runtime.worker.inputs import Fence
from flowrl.runtime.worker.ranks import GroupStep, RankGroup
from flowrl.runtime.worker.runner import NodeRunner
from flowrl.runtime.worker.shape import Shape
from flowrl.runtime.worker.version import WeightVersion


class WeightSyncs:
    """Owns the sync orders a follower keeps until its leader's step names them."""

    def __init__(self, weights, runner: NodeRunner, version: WeightVersion, fence: Fence, *, shape: Shape,
                 ranks: RankGroup | None, report: Callable[[Any], Awaitable[None]],
                 released: Callable[[int], Awaitable[None]], fetch: bool = False):
        self._weights = weights  # the WeightsClient (None: this process takes no part in weight sync)
        self._runner = runner
        self._version = version
        self._fence = fence
        self._shape = shape
        self._ranks = ranks  # this rank's data-parallel group (None: one rank)
        self._report = report
        self._released = released  # a subscriber's new version: the batches that waited for it go on
        self._orders: dict = {}  # a data-parallel subscriber's follower: Sync orders by sync epoch
        self._awaiting = None  # ... the sync epoch its leader's step named before the order came
        # a publisher's orders, served in order beside the node's calls (`serve_lane`)
        self.beside = weights is not None and shape.publishes and not shape.subscribes
        # unbounded: the control loop hands orders over and never waits (an order is a few numbers)
        self._lane_tx, self._lane_rx = anyio.create_memory_object_stream[m.Sync](math.inf)
        self._serving = anyio.Lock()  # held by a serve of the lane, and through a rollback (`apart`)
        # a plain subscriber's rounds, received as their orders arrive (`fetch`: one call at a time and
        # no take-turns group, the worker's say)
        plain = fetch and weights is not None and shape.subscribes and not shape.publishes and ranks is None
        self.fetches = FetchLane(weights, runner) if plain else None

    def fence(self, sync_epoch: int) -> None:
        """A member died (any thread): stop waiting for the members of an older sync epoch."""
        if self._weights is not None:
            self._weights.fence(sync_epoch)

    async def order(self, order: m.Sync) -> None:
        """A `Sync` order from the controller."""
        if self._take(order):  # a publisher's: to its lane (the control loop hands them over itself)
            return
        if self._ranks is not None and self._shape.subscribes:
            if self._ranks.rank > 0:  # kept until the leader's step names this sync epoch
                self._orders = {e: o for e, o in self._orders.items() if e > order.sync_epoch - 8}
                self._orders[order.sync_epoch] = order
                if self._awaiting == order.sync_epoch:
                    await self.join(order.sync_epoch)
                return
            if not await self._ranks.lead(None, GroupStep(sync=order.sync_epoch), epoch=self._fence.epoch,
                                          marker="sync"):
                return  # a rank is in a newer recovery epoch: the recovery forms a new sync epoch
        await self.run(order)

    def arrived(self, msg: Any) -> bool:
        """The control loop got `msg` (its thread, before the event queue). A `Sync`: older epochs are
        fenced at once, a publisher's order goes straight to its lane (True: nothing more to do), a
        plain subscriber's round starts (`FetchLane.start` says when not)."""
        if self.fetches is not None and isinstance(msg, (m.Epoch, m.Stop)):
            self.fetches.held(msg)
        if isinstance(msg, m.Epoch) and self._weights is not None:
            # a recovery disbands the weight group and its end forms a newer epoch: no round of an
            # epoch ordered so far can complete (a member is down), so none is waited for meanwhile
            self._weights.rolled_back()
        if not isinstance(msg, m.Sync):
            return False
        if self._take(msg):
            return True
        if self.fetches is not None:
            self.fetches.start(msg)
        return False

    def _take(self, order: m.Sync) -> bool:
        self.fence(order.sync_epoch)  # a member died: stop waiting for the old epoch
        if self.beside:  # served beside the node's calls, not after the one running
            self._lane_tx.send_nowait(order)
        return self.beside

    def apart_from(self, handler: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        """`handler` (the `Epoch` order's) run `apart` from every serve."""
        async def run(msg) -> None:
            try:
                async with self.apart():
                    await handler(msg)
            finally:
                if self.fetches is not None and isinstance(msg, m.Epoch):
                    self.fetches.handled(msg)
        return run

    async def serve_lane(self) -> None:
        """A publisher's sync orders, one at a time and in order, beside the node's calls (the
        worker runs this in its task group while the process lives)."""
        async for order in self._lane_rx:
            async with self._serving:
                await self.run(order)

    @contextlib.asynccontextmanager
    async def apart(self) -> AsyncIterator[None]:
        """Around a rollback (`Epoch` order): no serve runs meanwhile. The trainer reports `recovered`
        before it restores and snapshots the checkpoint's weights, and the controller orders the
        next sync at once: served beside the rollback, it would send the weights from before it."""
        if not self.beside:
            yield
            return
        async with self._serving:
            yield

    def stop(self) -> None:
        """The process stops (or fails): a serve still waiting for its members, or a round a
        subscriber receives ahead, ends within a quarter second."""
        if self.beside or self.fetches is not None:
            self._weights.fence(2**62)

    async def join(self, sync_epoch: int) -> None:
        """A follower's part of its leader's sync step (its own `Sync` order may come later)."""
        order = self._orders.pop(sync_epoch, None)
        self._awaiting = None if order is not None else sync_epoch
        if order is not None:
            await self.run(order)

    async def run(self, order: m.Sync) -> None:
        """One sync round (or landing the round `FetchLane` received); `Synced` or `SyncFailed` to
        the controller."""
        fetch = self.fetches.taken(order) if self.fetches is not None else None
        try:
            with self._runner.occupied(f"weight sync v{order.version}"):
                if fetch is not None:
                    received = await self._weights.land_fetched(fetch, self._runner)
                    fetch.ok = True
                else:
                    received = await self._weights.sync(order, self._version.value, self._runner)
        except Exception as e:  # noqa: BLE001 - reported; the controller forms a new epoch
            from flowrl.weights import LayoutMismatchError

            await self._report(m.SyncFailed(sync_epoch=order.sync_epoch, error=str(e)[:2000],
                                            permanent=isinstance(e, LayoutMismatchError)))
            return
        finally:
            if fetch is not None:
                fetch.landed.set()
            elif self.fetches is not None:
                self.fetches.ran(order)
        if not self._shape.publishes:
            self._version.set(received)
        await self._report(m.Synced(version=received, sync_epoch=order.sync_epoch, **self._weights.digest(received)))
        if not self.beside:  # a publisher holds no batches for a version (and runs beside the event queue)
            await self._released(self._version.value)
        if self._shape.observer:
            with self._runner.occupied(f"observe v{received}"):
                await self._runner.run(self._runner.node.observe, received)


class FetchLane:
    """A plain subscriber's rounds, received one at a time as their orders arrive (`run` is the
    task the worker keeps while the process lives); the next starts once the last landed or failed
    (`WeightSyncs.run`, in the order's place on the event queue): the staging buffers are free again.
    Once a round landed, the subscriber says at once that it is ready for the next round of its epoch
    (`WeightSubscriber.announce_ahead`), unless that round may run whole (a rollback queued, one
    waiting to run whole) or its order already came: the publisher's ready wait then finds it ready
    when the round is ordered, and, as the publisher's only member, the receive goes without a go."""

    def __init__(self, weights, runner: NodeRunner):
        self._weights = weights
        self._runner = runner
        self._tx, self._rx = anyio.create_memory_object_stream[Fetch](math.inf)
        self._fetched: dict[int, Fetch] = {}  # by id() of the order object, queued on the event queue
        # orders queued or running whose round runs whole in their turn, by id() (held: no id is reused meanwhile)
        self._whole: dict[int, m.Sync] = {}
        self._ran = anyio.Event()  # set (and made anew) whenever one of them ran
        self._rollbacks = 0  # `Epoch` orders on the event queue, not handled yet
        self._stopping = False

    def held(self, msg: m.Epoch | m.Stop) -> None:
        """A rollback queued (until `handled`), or the end of the process."""
        if isinstance(msg, m.Stop):
            self._stopping = True
        else:
            self._rollbacks += 1

    def handled(self, msg: m.Epoch) -> None:
        """A rollback `held` ran (`WeightSyncs.apart_from`)."""
        self._rollbacks = max(0, self._rollbacks - 1)

    def start(self, order: m.Sync) -> None:
        """Receive `order`'s round ahead, unless it runs whole in its turn: a handoff (a turn of its
        own), the first round of a subscriber not made yet (making it repoints a module's tensors:
        not while a call runs), a rollback queued ahead (it may make the subscriber anew), or a
        process that is stopping. Behind a round still to run whole (two rounds never run at once:
        they share the subscriber and its staging buffers) it is received once that one ran: had it
        run whole too, under load every round of a run could (each order arriving while the one
        before still waited behind a call), none beside the calls."""
        if order.handoff or self._rollbacks or self._stopping or self._weights.sub is None:
            self._whole[id(order)] = order
            return
        fetch = self._fetched[id(order)] = Fetch(order, after=dict(self._whole))
        self._tx.send_nowait(fetch)

    def taken(self, order: m.Sync) -> Fetch | None:
        """The round fetched for `order` (now at its turn on the event queue), if one was."""
        return self._fetched.pop(id(order), None)

    def ran(self, order: m.Sync) -> None:
        """`order`'s round ran whole in its turn (delivered or failed)."""
        self._whole.pop(id(order), None)
        self._ran.set()
        self._ran = anyio.Event()

    async def run(self) -> None:
        async for fetch in self._rx:
            while fetch.after.keys() & self._whole.keys():  # rounds queued ahead of it that run whole: they go first
                await self._ran.wait()
            try:
                with self._runner.occupied(f"weight sync v{fetch.order.version}"):
                    fetch.received = await self._weights.fetch(fetch.order)
            except Exception as e:  # noqa: BLE001 - `WeightSyncs.run` reports it, in the order's place
                fetch.error = e
            finally:
                fetch.done.set()
            await fetch.landed.wait()
            ordered = self._rx.statistics().current_buffer_used  # the next order came: its receive says it
            if fetch.ok and not (self._rollbacks or self._stopping or self._whole or ordered):
                await blocking.run(self._weights.announce_ahead)  # the next round is fetched too


class Fetch:
    """One round a plain subscriber receives ahead of its order's turn (`FetchLane`)."""

    def __init__(self, order: m.Sync, after: dict[int, m.Sync] | None = None):
        self.order = order
        self.after = after or {}  # the orders ahead of it whose rounds run whole (received after them), by id()
        self.received: int | None = None
        self.error: BaseException | None = None
        self.done = anyio.Event()  # received (or failed)
        self.landed = anyio.Event()  # its order ran: the staging buffers are free for the next round
        self.ok = False  # ...and the round landed
