"""Data parallelism inside a node: every rank takes its shard of every batch, a dead rank takes its
group down and the group comes back together — with the ledger and the states exactly once."""

from __future__ import annotations


import numpy as np
import pytest

from flowrl.node import Drop
from flowrl.runtime.worker.ranks import merge_outputs, split_groups
from flowrl.testing import node_state, run_graph
from flowrl.transport import Batch

N = "flowrl.testing.nodes"


def test_shards_never_cut_a_prompt_group_and_merge_back_in_rank_order():
    b = Batch(tensors={"x": np.arange(12)}, meta={"samples_per_prompt": 3})
    shards = split_groups(b, 2)
    assert [list(s.tensors["x"]) for s in shards] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    three = split_groups(b, 3)  # 4 groups over 3 ranks: 2, 1, 1 groups
    assert [s.num_samples for s in three] == [6, 3, 3]
    assert list(merge_outputs(three).tensors["x"]) == list(range(12))
    assert list(merge_outputs([shards[0], Drop("filtered"), shards[1]]).tensors["x"]) == list(range(12))
    assert isinstance(merge_outputs([Drop("a"), Drop("b")]), Drop)


DP = f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  scale: {{kind: "{N}:Scale", devices: 2}}
  norm: {{kind: "{N}:Normalizer", devices: 2}}
  collect: {{kind: "{N}:Chain", devices: 2}}
edges: [numbers -> scale, scale -> norm, norm -> collect]
schedule: {{steps: 10, batch_size: 4, max_staleness: 1, checkpoint_every: 3}}
supervision: {{heartbeat_s: 0.2, deadline_s: 3.0, process_timeout_s: 10}}
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    (d / "g.yaml").write_text(DP)
    result = run_graph(d / "g.yaml", d / "run", timeout_s=150)
    assert result.exit_code == 0, result.stderr[-2000:]
    return result


async def _follower(epoch: int):
    """A follower rank's components alone (no process; its node passes batches through)."""
    from tests.runtime.worker_kit import Tx, build, shape

    return await build(shape(sink=True, stateful=True), epoch=epoch, rank=1, world_size=2, peers={0: Tx()})


def test_a_follower_answers_a_shard_of_an_older_epoch_and_holds_one_of_a_newer_epoch():
    """The leader waits for every rank's answer before any rank runs: a follower already in the
    recovery epoch answers an older shard with a drop (nobody runs it; the leader, still in the old
    epoch, would otherwise wait in a collective for it forever); a shard of an epoch the follower
    has not entered yet waits for it instead of being lost."""
    import anyio

    from flowrl.runtime.worker.ranks import SHARD

    from tests.runtime.worker_kit import Rx

    async def main():
        f, rx = await _follower(2), Rx()
        leader = f.ranks.senders()[0]
        old = Batch(tensors={"x": np.arange(4)}, batch_id="t-000007", attempt=1, index=7, epoch=1)
        await f.path.on_arrival((SHARD, old, rx))
        (answer,) = leader.sent
        assert (answer.batch_id, answer.attempt, answer.epoch, answer.drop, answer.meta["_rank"],
                answer.meta["_reply"]) == ("t-000007", 1, 1, "older epoch", 1, "accept")
        assert rx.acked == ["t-000007"]
        newer = Batch(tensors={"x": np.arange(4)}, batch_id="t-000008", index=8, epoch=3)
        await f.path.on_arrival((SHARD, newer, rx))
        assert rx.acked == ["t-000007"] and len(leader.sent) == 1  # held, not run, not lost
        assert [a[1].batch_id for a in f.policies.fence.enter(3)] == ["t-000008"]
        f.close()

    anyio.run(main)


@pytest.mark.timeout(180)
def test_every_rank_processes_half_of_every_batch(reference):
    assert reference.audit(["collect"]).exactly_once
    for rank in (0, 1):
        state = node_state(reference.run_dir, "norm", rank=rank)
        assert state["count"] == 10
        seen = node_state(reference.run_dir, "collect", rank=rank)["seen"]
        # Numbers gives x = [4i .. 4i+3]; rank 0 takes the first two, rank 1 the last two (x2 by scale)
        assert [s for _, s in seen] == [2 * (4 * i + 2 * rank) + 2 * (4 * i + 2 * rank + 1) for i in range(10)]
    rows = [r for r in reference.metrics if "rank_samples" in str(r)]
    assert rows, "per-rank sample counts are in the metrics"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["kill:norm/0/1@step=4", "kill:scale/0/1@step=6", "kill:collect/0/0@step=5"])
def test_a_dead_rank_restarts_its_group_and_every_state_matches_a_fault_free_run(tmp_path, reference, fault):
    (tmp_path / "g.yaml").write_text(DP)
    result = run_graph(tmp_path / "g.yaml", tmp_path / "run", faults=[fault], timeout_s=150)
    assert result.exit_code == 0, result.stderr[-2000:]
    assert result.audit(["collect"]).exactly_once
    killed = fault.split(":")[1].split("@")[0]
    mate = killed[:-1] + ("0" if killed.endswith("1") else "1")
    # the whole group went down and came back; the killed rank is the one named, its partner went
    # down with it (one record each, whether its collective broke first or it was stopped)
    downs = [(r["node"], r["why"]) for r in result.ledger if r["event"] == "node_down"]
    assert downs == [(killed, "exited"), (mate, f"its rank group lost {killed}")], downs
    for n in ("norm", "collect"):
        for rank in (0, 1):
            assert node_state(result.run_dir, n, rank=rank) == node_state(reference.run_dir, n, rank=rank)


def test_the_leader_gathers_replies_of_three_ranks_whatever_their_order():
    """Rank 2 answering before rank 1 used to be thrown away while waiting for rank 1, and the
    leader then waited for it forever."""
    import anyio

    from flowrl.runtime.worker.inputs import Item
    from tests.runtime.worker_kit import Rx, build

    def reply(rank, bid="t-000003", attempt=0):
        return Batch(tensors={"x": np.full(2, rank)}, batch_id=bid, attempt=attempt, index=3, meta={"_rank": rank})

    async def main():
        rx = Rx([reply(1, "t-000002"), reply(2), reply(1, attempt=1), reply(1)])
        leader = await build(world_size=3, rank_rx=rx)
        item = Item(3, "t-000003", 0, 0, "in", None)
        one, two = await leader.ranks.gather(item, 1), await leader.ranks.gather(item, 2)
        assert one.tensors["x"].tolist() == [1, 1] and two.tensors["x"].tolist() == [2, 2]
        assert "_rank" not in one.meta and rx.replies == []
        leader.close()

    anyio.run(main)


@pytest.mark.timeout(60)
def test_a_leader_hands_its_follower_the_shard_before_any_rank_enters_a_collective():
    """The deadlock of data-parallel PPO, without processes: the leader's send of the shard only
    queues it (the channel writes it when the event loop next turns, as a corked ZeroMQ pump does),
    and `process` is a collective that returns only once the follower has its shard and joins. A
    leader that ran `process` on the event loop's thread never let the loop turn: the shard stayed
    queued and the collective waited for ever (here: 20 s, then an error). The leader now waits for
    the follower's answer to the shard, and runs `process` on its compute thread."""
    import asyncio
    import threading

    import anyio

    from flowrl.runtime.worker.inputs import Item
    from flowrl.runtime.worker.ranks import GroupStep
    from tests.runtime.worker_kit import build

    joined = threading.Event()  # the follower is in the collective

    class CorkedTx:  # the leader's channel to rank 1: delivered when the loop turns
        def __init__(self, inbox):
            self.inbox = inbox

        async def send(self, batch):
            asyncio.get_running_loop().call_soon(self.deliver, batch)

        def deliver(self, shard):  # rank 1 answers at once; on the verdict, joins and returns its result
            if "_verdict" not in shard.meta:
                self.shard = shard
                self.inbox.put_nowait(shard.replace(meta={"_rank": 1, "_reply": "accept"}))
                return
            assert shard.meta["_verdict"] == "go"
            joined.set()
            self.inbox.put_nowait(self.shard.replace(meta={"_rank": 1, "_reply": "result"}))

    class Inbox:
        def __init__(self):
            self.q = asyncio.Queue()

        def put_nowait(self, b):
            self.q.put_nowait(b)

        async def recv(self):
            return await self.q.get()

        async def ack(self, b):
            pass

    class Node:
        async def setup(self):
            pass

        async def process(self, batch, port):  # an all-reduce: needs rank 1
            if not joined.wait(20):
                raise RuntimeError("collective timed out: rank 1 never got its shard")
            return batch

    async def main():
        inbox = Inbox()
        leader = await build(node=Node(), world_size=2, rank_rx=inbox, peers={1: CorkedTx(inbox)})
        batch = Batch(tensors={"x": np.arange(4)}, batch_id="t-000001", index=1)
        out = await leader.ranks.run_ranks(Item.of_batch("in", batch, None), GroupStep(), "process")
        assert out["out"].tensors["x"].tolist() == [0, 1, 2, 3]  # both halves, in rank order
        leader.close()

    anyio.run(main)


def test_with_three_ranks_one_follower_in_a_newer_epoch_means_no_rank_enters_the_step():
    """Rank 2 already entered the recovery epoch and answers the shard with a drop; rank 1 accepted.
    The leader neither runs its shard nor lets rank 1 run its: rank 1 gets `abort` (with `go` it
    would wait in the collective for ranks that never come)."""
    import anyio

    from flowrl.runtime.worker.inputs import Item
    from flowrl.runtime.worker.ranks import SKIPPED, GroupStep
    from tests.runtime.worker_kit import Rx, Tx, build

    class Node:
        async def setup(self):
            pass

        async def process(self, batch, port):
            raise AssertionError("the leader ran a step a follower refused")

    async def main():
        route = dict(batch_id="t-000004", attempt=0, index=4, epoch=1)
        rx = Rx([Batch(meta={"_rank": 2, "_reply": "accept"}, drop="older epoch", **route),
                 Batch(meta={"_rank": 1, "_reply": "accept"}, **route)])
        to1, to2 = Tx(), Tx()
        leader = await build(node=Node(), world_size=3, rank_rx=rx, peers={1: to1, 2: to2})
        batch = Batch(tensors={"x": np.arange(6)}, **route)
        assert await leader.ranks.run_ranks(Item.of_batch("in", batch, None), GroupStep(), "process") is SKIPPED
        (shard1, verdict1), (shard2,) = to1.sent, to2.sent
        assert verdict1.meta["_verdict"] == "abort" and shard1.num_samples == shard2.num_samples == 2
        leader.close()

    anyio.run(main)


@pytest.mark.parametrize("verdict", ["go", "abort"])
def test_a_follower_does_an_accepted_step_on_go_even_in_a_newer_epoch_but_keeps_none_of_its_bookkeeping(verdict):
    """Rank 1 accepted ticket 5 in epoch 1, then entered epoch 2 (its Epoch order came first), then the
    leader's verdict arrived. On `go` it runs its shard (the leader is in that collective) and answers,
    and makes the checkpoint's state (the leader, still in epoch 1, saves it, and a sharded state_dict
    may gather), but neither moves its watermark nor keeps the checkpoint (no file, no report: epoch
    2's restore comes next); on `abort` nothing runs. Before, it skipped the state too, and a leader
    whose state_dict gathers waited in that collective until the recovery's timeout failed the run
    (chaos seed 73: `kill:sink@checkpoint=5` beside a data-parallel stateful sink)."""
    import anyio

    from flowrl.runtime.protocol import messages as m
    from flowrl.runtime.worker.ranks import SHARD, GroupStep
    from tests.runtime.worker_kit import Rx

    async def main():
        f, rx = await _follower(1), Rx()
        leader = f.ranks.senders()[0]
        made, state_dict = [], f.runner.node.state_dict
        f.runner.node.state_dict = lambda: made.append(1) or state_dict()
        f.policies.ordered.follow_leader(5)
        route = dict(batch_id="t-000005", attempt=0, index=5, epoch=1)
        step = GroupStep(checkpoint=6)
        await f.path.on_arrival((SHARD, Batch(tensors={"x": np.arange(2)}, meta={"_step": step.meta(), "_port": "in"},
                                              **route), rx))
        assert leader.sent[-1].meta["_reply"] == "accept" and f.ranks.waiting() is not None
        f.policies.fence.enter(2)
        await f.path.on_arrival((SHARD, Batch(meta={"_verdict": verdict}, **route), rx))
        assert f.ranks.waiting() is None
        ran = f.runner.node.seen
        if verdict == "go":
            assert ran == ["t-000005"] and leader.sent[-1].meta["_reply"] == "result" and made == [1]
        else:
            assert ran == [] and len(leader.sent) == 1 and made == []
        assert f.path.watermark == 5 and not any(isinstance(r, m.Checkpointed) for r in f.reports)
        f.close()

    anyio.run(main)
