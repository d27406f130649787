"""Input policies on their own: fences, version gates, joins, in-order delivery, once-only sinks."""

from flowrl.runtime.worker.inputs import Fence, Item, JoinBuffer, Ordered, OutputCache, SinkSeen, VersionGate
from flowrl.transport import Batch


def b(index, attempt=0, epoch=0, drop=None, min_version=0):
    return Batch(tensors={}, batch_id=f"t-{index:06d}", attempt=attempt, index=index, epoch=epoch, drop=drop,
                 min_version=min_version)


def test_fence_drops_older_epochs_and_holds_newer_ones_until_entered():
    f = Fence(1)
    assert f.classify(0) == "stale" and f.classify(1) == "ok" and f.classify(2) == "future"
    f.future += [("in", b(3, epoch=2), None), ("in", b(4, epoch=3), None)]
    held = f.enter(2)
    assert [a[1].index for a in held] == [3] and [a[1].index for a in f.future] == [4]
    f.future.append(("in", b(5, epoch=4), None))
    # an epoch skipped over (3): what waited for it comes back, stale now, to be dropped and acked
    assert [a[1].index for a in f.enter(5)] == [4, 5] and f.future == []


def test_version_gate_releases_batches_once_the_weights_arrive():
    g = VersionGate()
    assert not g.admits(3, 2)
    g.hold(("in", b(1, min_version=3), None))
    g.hold(("in", b(2, min_version=5), None))
    assert [a[1].index for a in g.release(4)] == [1]
    assert [a[1].index for a in g.clear()] == [2]


def test_join_gathers_each_attempt_once_and_hands_back_every_copy_it_drops():
    j = JoinBuffer(("a", "b"))
    assert j.offer("a", b(1), "rxa") == (None, [])
    item, drops = j.offer("a", b(1), "rxa2")
    assert item is None and drops == [("rxa2", drops[0][1], "duplicate part")]  # acked, credit returns
    item, drops = j.offer("b", b(1), "rxb")
    assert item.index == 1 and set(item.parts) == {"a", "b"} and len(item.acks) == 2 and not drops
    assert j.offer("b", b(1), "late")[1][0][2] == "already joined"
    # a re-issue (attempt 1) is joined again: downstream may have lost the first result
    j.offer("a", b(1, attempt=1), "x")
    item, _ = j.offer("b", b(1, attempt=1), "y")
    assert item.attempt == 1
    # a newer attempt supersedes a half-gathered older one, whose part is acked
    j.offer("a", b(2), "old")
    _, drops = j.offer("b", b(2, attempt=1), "new")
    assert [d[2] for d in drops] == ["superseded attempt"]


def test_join_of_a_drop_marker_is_a_drop():
    j = JoinBuffer(("a", "b"))
    j.offer("a", b(5, drop="filter: empty"), None)
    item, _ = j.offer("b", b(5), None)
    assert item.drop == "filter: empty"


def test_a_join_of_two_markers_says_the_same_whichever_came_first_and_a_replacement_wins():
    for order in (("a", "b"), ("b", "a")):
        j = JoinBuffer(("a", "b", "c"))
        markers = {"a": "filter: empty", "b": "[replace] dapo: held", "c": None}
        for port in (*order, "c"):
            item, _ = j.offer(port, b(5, drop=markers[port]), None)
        assert item.drop == "[replace] dapo: held" and list(item.parts) == ["a", "b", "c"]


def test_ordered_delivery_hands_out_tickets_in_index_order_each_once():
    o = Ordered(watermark=2)
    items = {i: Item(i, f"t{i}", 0, 0) for i in (1, 2, 3, 4)}
    assert o.offer(items[4]) == "buffered" and o.next_ready() is None
    assert o.offer(items[1]) == "replay"
    assert o.offer(items[3]) == "buffered" and o.offer(Item(3, "t3", 1, 0)) == "duplicate"
    assert o.offer(items[2]) == "buffered"
    got = []
    while (it := o.next_ready()) is not None:
        got.append(it.index)
        o.done(it.index)
    assert got == [2, 3, 4] and o.watermark == 5
    assert o.reset(2) == [] and o.watermark == 2


def test_sink_seen_consumes_each_ticket_once_across_a_restart():
    s = SinkSeen(low=3, consumed=[5])
    assert not s.first_time(1) and not s.first_time(5) and s.first_time(4) and not s.first_time(4)


def test_output_cache_forgets_what_every_sink_has():
    c = OutputCache()
    c.put(1, "one")
    c.put(2, "two")
    c.forget_below(2)
    assert c.get(1) is None and c.get(2) == "two"


def test_a_join_gives_a_held_parts_credit_back_at_once_so_reordered_parts_cannot_deadlock_it():
    """After a re-issue the parts of tickets 7, 8 can sit on port a while 9, 10 sit on port b: had
    they kept their credit (2 per link), neither producer could send the partner the other waits
    for (seen in the shape x fault campaign). Held parts are acknowledged on arrival; the joined
    item still acknowledges them (idempotent) and a restart of the join re-issues open tickets."""
    import anyio

    from tests.runtime.worker_kit import Rx, build, shape

    class JoinNode:
        def __init__(self):
            self.joined = []

        async def setup(self):
            pass

        async def join(self, parts):
            self.joined.append(parts["a"].batch_id)
            return parts["a"]

    async def main():
        node, rx_a, rx_b = JoinNode(), Rx(), Rx()
        kit = await build(shape(join=True, inputs=("a", "b")), node=node)
        for i in (7, 8):
            await kit.path.on_arrival(("a", b(i, attempt=1), rx_a))
        for i in (9, 10):
            await kit.path.on_arrival(("b", b(i, attempt=1), rx_b))
        assert rx_a.acked == ["t-000007", "t-000008"] and rx_b.acked == ["t-000009", "t-000010"]
        assert node.joined == []
        await kit.path.on_arrival(("b", b(7, attempt=1), rx_b))
        assert node.joined == ["t-000007"]
        kit.close()

    anyio.run(main)


def test_a_trainer_takes_the_tickets_of_one_update_together_once_all_are_here():
    o = Ordered(watermark=4, per_update=4)
    for i in (6, 4, 5):
        assert o.offer(Item(i, f"b{i}", 0, 0)) == "buffered"
    assert o.next_update(end=16) is None  # ticket 7 is still missing
    assert o.offer(Item(5, "b5", 1, 0)) == "duplicate" and o.watermark == 4
    o.offer(Item(7, "b7", 0, 0))
    assert [it.index for it in o.next_update(end=16)] == [4, 5, 6, 7]
    o.done(7)
    assert o.watermark == 8 and o.offer(Item(6, "b6", 1, 0)) == "replay"
    o.offer(Item(8, "b8", 0, 0))
    assert [it.index for it in o.next_update(end=9)] == [8]  # the run's end cuts the last update short
    assert [it.index for it in o.reset(4)] == [] and o.watermark == 4
