"""`WeightSyncs` (flowrl/runtime/worker/syncs.py) owns the sync orders of a node process: a
subscriber takes the version it received and the batches that waited for it go on; a failed round
leaves the version as it was; a data-parallel follower joins a sync only when its leader's step
names it, whichever of the order and the step comes first; a plain subscriber receives a round as
its order arrives and lands it in the order's turn."""

from __future__ import annotations

import anyio
import numpy as np

from flowrl.runtime.protocol import messages as m
from flowrl.transport import Batch
from tests.runtime.worker_kit import Rx, Tx, build, shape


class Weights:
    def __init__(self, fail: bool = False):
        self.fail, self.rounds = fail, []

    async def sync(self, order, version, runner):
        self.rounds.append(order.sync_epoch)
        if self.fail:
            raise RuntimeError("a member left")
        return order.version

    def digest(self, version):
        return {}

    def fence(self, sync_epoch):
        pass

    def rolled_back(self):
        pass


def _sync(version: int, sync_epoch: int = 1) -> m.Sync:
    return m.Sync(sync_epoch=sync_epoch, version=version, rank=1, world_size=2, store=["h", 1], timeout_s=1.0)


def test_a_subscriber_takes_the_version_and_releases_the_batches_that_waited_for_it():
    async def main():
        kit = await build(shape(subscribes=True), weights=Weights())
        rx = Rx()
        await kit.path.on_arrival(("in", Batch(tensors={"x": np.arange(2)}, batch_id="t-1", min_version=2), rx))
        assert rx.acked == [] and kit.runner.node.seen == []  # held by the version gate
        await kit.syncs.order(_sync(2))
        assert kit.version.value == 2 and kit.runner.node.seen == ["t-1"] and rx.acked == ["t-1"]
        assert [type(r).__name__ for r in kit.reports] == ["Synced"]
        kit.close()

    anyio.run(main)


def test_a_failed_sync_keeps_the_version_and_says_so():
    async def main():
        kit = await build(shape(subscribes=True), weights=Weights(fail=True))
        await kit.syncs.order(_sync(3))
        assert kit.version.value == 0 and kit.runner.busy is None
        (failed,) = kit.reports
        assert isinstance(failed, m.SyncFailed) and "a member left" in failed.error
        kit.close()

    anyio.run(main)


def test_a_follower_joins_a_sync_when_its_leaders_step_names_it_in_either_order():
    async def main():
        weights = Weights()
        kit = await build(shape(subscribes=True), weights=weights, rank=1, world_size=2, peers={0: Tx()})
        await kit.syncs.order(_sync(4, sync_epoch=5))  # the order first: kept
        assert weights.rounds == []
        await kit.syncs.join(5)  # the leader's step: now
        assert weights.rounds == [5] and kit.version.value == 4
        await kit.syncs.join(6)  # the step first: waits for the order
        assert weights.rounds == [5]
        await kit.syncs.order(_sync(5, sync_epoch=6))
        assert weights.rounds == [5, 6] and kit.version.value == 5
        kit.close()

    anyio.run(main)


class FencedWeights(Weights):
    sub = None  # no subscriber made yet: a plain subscriber's rounds then run whole in their turn

    def __init__(self):
        super().__init__()
        self.fences = []

    def fence(self, sync_epoch):
        self.fences.append(sync_epoch)

    def rolled_back(self):
        self.fences.append("rolled back")


def test_a_rollback_fences_every_sync_epoch_ordered_before_it():
    """A recovery disbands the weight group and its end forms a newer epoch: a round of an older
    one (a subscriber connecting to the store of a publisher that died, which torch retries until
    its timeout) stops waiting when the rollback arrives, not when the newer epoch's order does,
    which comes only after every process has rolled back."""
    async def main():
        for sh in (shape(subscribes=True), shape(publishes=True, stateful=True)):
            weights = FencedWeights()
            kit = await build(sh, weights=weights, fetch=True)
            kit.syncs.arrived(_sync(3, sync_epoch=4))
            kit.syncs.arrived(m.Epoch(epoch=1, watermark=0))
            assert weights.fences == [4, "rolled back"]
            kit.close()

    anyio.run(main)


def test_a_rolled_back_client_fences_every_epoch_ordered_so_far_and_no_newer_one():
    """`WeightsClient.rolled_back`, once or as often as a recovery resends its order: the epoch the
    recovery's end forms (newer than every one ordered) is never stale."""
    from flowrl.runtime.worker.weightsync import WeightsClient

    client = WeightsClient(None, publisher=False, device="cpu", recorder=None, faults=None, secret="s" * 32)
    client.fence(4)
    client.rolled_back()
    client.rolled_back()
    assert (client.ordered, client.fenced) == (4, 5)
    client.fence(5)  # the recovery's end: epoch 5 goes on
    assert (client.ordered, client.fenced) == (5, 5)


class HeldWeights(Weights):
    """A publisher's `sync` that waits until the test lets it go (a serve waiting for its members)."""

    def __init__(self):
        super().__init__()
        self.started, self.go = anyio.Event(), anyio.Event()

    async def sync(self, order, version, runner):
        self.started.set()
        await self.go.wait()
        return await super().sync(order, version, runner)


def test_a_publisher_serves_in_order_beside_its_calls_but_never_during_a_rollback():
    """Orders go to the lane and return at once; the lane serves them one by one; a rollback
    (`apart`) waits for the serve under way, and a serve ordered meanwhile waits for the rollback."""
    async def main():
        weights = HeldWeights()
        kit = await build(shape(sink=True, stateful=True, publishes=True), weights=weights)
        assert kit.syncs.beside
        async with anyio.create_task_group() as tg:
            tg.start_soon(kit.syncs.serve_lane)
            with anyio.fail_after(5):
                await kit.syncs.order(_sync(1, sync_epoch=1))  # handed over, not served here
                await kit.syncs.order(_sync(2, sync_epoch=1))
                await weights.started.wait()
                assert weights.rounds == []  # the first serve is waiting for its members
                order_of_events = []

                async def rollback():
                    async with kit.syncs.apart():
                        order_of_events.append(("rollback", list(weights.rounds)))

                tg.start_soon(rollback)
                await anyio.wait_all_tasks_blocked()
                assert order_of_events == []  # the rollback waits for the serve under way
                weights.go.set()
                while len(weights.rounds) < 2:
                    await anyio.sleep(0.01)
            assert order_of_events == [("rollback", [1])]  # between the two serves, not during one
            assert [type(r).__name__ for r in kit.reports] == ["Synced", "Synced"]
            tg.cancel_scope.cancel()
        kit.close()

    anyio.run(main)


async def settled() -> None:
    """Every task blocked and no blocking call under way (`announce_ahead` runs on a helper thread,
    blocking.py): what the lane does once a round landed is done."""
    from flowrl.runtime.worker import blocking

    while True:
        await anyio.wait_all_tasks_blocked()
        if blocking.pending() == 0:
            return
        await anyio.sleep(0.001)


class FetchingWeights(Weights):
    """A subscriber's client whose rounds are received ahead (`fetch`, held until the test lets
    each go) and made live in the order's turn (`land_fetched`), as `WeightsClient`'s; its
    subscriber is made by its first whole round (`sync`)."""

    def __init__(self):
        super().__init__()
        self.sub = None
        self.fetched: list[int] = []
        self.landed: list[int] = []
        self.go: dict[int, anyio.Event] = {}
        self.ahead: list[int] = []  # the round landed last when the lane said ready for the next (`announce_ahead`)

    async def sync(self, order, version, runner):
        self.sub = object()
        return await super().sync(order, version, runner)

    async def fetch(self, order):
        self.fetched.append(order.version)
        await self.go.setdefault(order.version, anyio.Event()).wait()
        return order.version

    async def land_fetched(self, fetch, runner):
        await fetch.done.wait()
        if fetch.error is not None:
            raise fetch.error
        self.landed.append(fetch.received)
        return fetch.received

    def announce_ahead(self):
        self.ahead.append(self.landed[-1])


def test_a_plain_subscriber_receives_a_round_as_its_order_arrives_and_lands_it_in_the_orders_turn():
    """The round starts when the control loop gets the order (a call may be running: the event
    queue is not needed), lands only when the order's turn on the event queue comes, and the next
    round starts only once the last landed (they share the staging buffers). A round runs whole in
    its turn when the subscriber is not made yet or when a rollback is queued ahead of it, and no
    round is fetched while such a one waits or runs (two rounds never run at once): one ordered behind
    it is fetched once it ran, not run whole as well (else, under load, every round could be). Once
    a fetched round landed, and the next round of the epoch will be fetched too (no rollback queued,
    none to run whole) and is not ordered yet, the subscriber says it is ready for that round at once
    (`announce_ahead`)."""
    async def main():
        weights = FetchingWeights()
        kit = await build(shape(subscribes=True), weights=weights, fetch=True)
        assert kit.syncs.fetches is not None and not kit.syncs.beside
        async with anyio.create_task_group() as tg:
            tg.start_soon(kit.syncs.fetches.run)
            with anyio.fail_after(5):
                zeroth, again = _sync(0), _sync(0)
                kit.syncs.arrived(zeroth)  # no subscriber yet: made in the order's turn, not during a call
                weights.sub = object()
                kit.syncs.arrived(again)  # behind a round still to run whole: fetched once that one ran
                await settled()
                assert weights.fetched == []
                await kit.syncs.order(zeroth)
                assert weights.rounds == [1]
                await settled()
                assert weights.fetched == [0]
                weights.go.setdefault(0, anyio.Event()).set()
                await kit.syncs.order(again)
                assert weights.rounds == [1] and weights.landed == [0]
                await settled()
                assert weights.ahead == [0]  # a whole round (`zeroth`) says nothing ahead; a fetched one does
                first, second = _sync(1), _sync(2)
                assert not kit.syncs.arrived(first) and not kit.syncs.arrived(second)  # both go on the event queue
                await settled()
                assert weights.fetched == [0, 1] and kit.version.value == 0  # receiving; nothing landed
                weights.go.setdefault(1, anyio.Event()).set()
                weights.go.setdefault(2, anyio.Event()).set()
                await settled()
                assert weights.fetched == [0, 1]  # the next round waits until this one landed
                await kit.syncs.order(first)  # its turn
                assert kit.version.value == 1 and weights.landed == [0, 1]
                await settled()
                assert weights.fetched == [0, 1, 2]

                rollback, third = m.Epoch(epoch=1, watermark=0), _sync(3, sync_epoch=2)
                assert not kit.syncs.arrived(rollback)
                kit.syncs.arrived(third)  # queued behind the rollback: runs whole in its turn
                await kit.syncs.order(second)
                handled = []

                async def enter_epoch(msg):
                    handled.append(msg.epoch)

                await settled()
                assert weights.ahead == [0]  # `first` landed with `second` ordered (its receive says it), `second`
                # with a rollback queued (the next round may run whole): nothing said ahead
                await kit.syncs.apart_from(enter_epoch)(rollback)
                fourth = _sync(4, sync_epoch=2)
                kit.syncs.arrived(fourth)  # the rollback is handled, but `third` has yet to run whole
                await settled()
                assert weights.fetched == [0, 1, 2] and weights.landed == [0, 1, 2] and kit.version.value == 2
                await kit.syncs.order(third)
                assert weights.rounds == [1, 2] and kit.version.value == 3
                await settled()
                assert weights.fetched == [0, 1, 2, 4]  # `third` ran: `fourth` is received now
                weights.go.setdefault(4, anyio.Event()).set()
                await kit.syncs.order(fourth)
                assert handled == [1] and weights.rounds == [1, 2] and kit.version.value == 4
                await settled()
                assert weights.ahead == [0, 4]
                kit.syncs.arrived(fifth := _sync(5, sync_epoch=2))
                await settled()
                assert weights.fetched == [0, 1, 2, 4, 5]  # nothing left to run whole: fetched ahead again
                weights.go.setdefault(5, anyio.Event()).set()
                await kit.syncs.order(fifth)
                assert kit.version.value == 5
                await settled()
                assert weights.ahead == [0, 4, 5]
            assert [type(r).__name__ for r in kit.reports] == ["Synced"] * 7
            tg.cancel_scope.cancel()
        kit.close()

    anyio.run(main)
