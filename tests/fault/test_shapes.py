"""Shape x fault, like Jepsen for this runtime: random DAGs of synthetic nodes (chains, fan-out,
joins, 1-3 sinks, stateful transforms, drops, replicas; ragged batches in half of them) under
random fault schedules (kill, two kills in one checkpoint interval, kill during a commit, SIGSTOP,
stuck in process, a lost message, a corrupt frame, a node that hangs in every incarnation); half of
them with concurrent stateless nodes, and a set with `schedule.ticket: group` (a stateful sink takes
an update's tickets in one call) whose concurrent node and stateful sink are killed.

Every run must end within its time bound, and then either have completed — every ticket consumed
or dropped once by every sink, every stateful node's final state bitwise equal to the model's (and
so to a fault-free run's) — or, for a schedule the runtime cannot recover from, have failed with an
error naming the node or the ticket. The fault-free run of each shape is the reference.

    python -m pytest tests/fault/test_shapes.py -q
    FLOWRL_CHAOS_JOBS=1 FLOWRL_CHAOS_HANG_S=40 python -m pytest tests/fault/test_shapes.py -q   # quicker "hung"

The same campaign, larger: `python benchmarks/chaos.py --shapes 300` (`--ranks --scale`: with
data-parallel nodes whose `process` runs a collective, a weight-publishing data-parallel sink, and
`flowrl scale` up and down mid-run).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading

import numpy as np
import pytest

import flowrl
from flowrl.graph import dump_graph
from flowrl.graph.loader import load_graph_text
from flowrl.testing.chaos import (
    Features,
    Schedule,
    check_ledger,
    compare_state,
    plan,
    random_schedule,
    random_shape,
    simulate,
)
from flowrl.testing.chaos import nodes as N
from flowrl.testing.chaos.campaign import campaign

SHAPE_SEEDS = [0, 1, 4, 6, 8, 10, 18, 22, 25, 47]
"""Chosen so that the CI set has every trait and every fault kind (a test below keeps it so)."""
PER_SHAPE = 3
SMALL = {"max_nodes": 6, "max_processes": 7, "steps": (10, 20)}
"""CI shapes: small and few steps (start-up, ~6 s a run on 2 cores, is most of the time)."""

FEATURES = Features.detect()
PLAN = plan(SHAPE_SEEDS, PER_SHAPE, FEATURES, **SMALL)
HOLD_SEEDS, HOLD_PER_SHAPE = [5, 12], 2
"""Shapes with a `Hold` node (a DAPO-like filter whose held tickets are replaced): a join, a
replicated sink and a stateful transform between them."""
HOLD_PLAN = plan(HOLD_SEEDS, HOLD_PER_SHAPE, FEATURES, holds=True, **SMALL)
HOLD_SCHEDULES = [s for _, scheds in HOLD_PLAN for s in scheds]
RANK_KW = {"ranks": True, "scale": True, **SMALL}
RANK_SEEDS, RANK_PER_SHAPE = [2, 78], 2
"""Shapes with data-parallel nodes whose `process` runs a collective, a weight-publishing
data-parallel trainer (a collective on every rank at each publish and checkpoint) and its
subscriber, under `flowrl scale` up and down mid-run: `drop` -> `sub` -> `drop2` -> `trainer` (2
ranks), the subscriber scaled and a replica just added killed (on the runtime before compute left
the event loop, the trainer's leader was left alone in its publish's all-gather in 2 of 3 runs of
s2.0); and `rmix` (2 ranks) -> `sub` -> `trainer` (3 ranks), a rank of the trainer killed."""
RANK_PLAN = plan(RANK_SEEDS, RANK_PER_SHAPE, FEATURES, **RANK_KW)
RANK_SCHEDULES = [s for _, scheds in RANK_PLAN for s in scheds]
GROUP_KW = {"groups": True, **SMALL}
GROUP_SEEDS, GROUP_PER_SHAPE = [33, 99], 1
GROUP_EXTRA = {
    33: [Schedule(33, 100, faults=["kill:merge@step=3", "kill:sink@step=2"], kinds=["kill", "kill"])],
    99: [Schedule(99, 100, faults=["kill:mix/0@step=2", "kill:sink@step=1"], kinds=["kill", "kill"])],
}
"""`schedule.ticket: group` shapes with concurrent nodes: `src -> {fold*, drop} -> merge (~3) ->
sink*` (3 tickets per update, ragged) and `src -> mix (x2, ~6) -> {sink*, log (~4)}` (3 per update).
Besides a drawn schedule each, by hand: a kill of the concurrent node while its earlier calls are
still in flight (each call waits for a partner, `nodes.Overlapping`), and a kill of the stateful
sink when it starts an update, with tickets of the next updates held or on the way
(`max_staleness` 2-3)."""
GROUP_PLAN = plan(GROUP_SEEDS, GROUP_PER_SHAPE, FEATURES, extra=GROUP_EXTRA, **GROUP_KW)
GROUP_SCHEDULES = [s for _, scheds in GROUP_PLAN for s in scheds]
SHAPES = {shape.seed: shape for shape, _ in PLAN}
SCHEDULES = [s for _, scheds in PLAN for s in scheds]


# --- the model, the generators and the checker, without processes ----------------------------

class _Recorder:
    def count(self, *a, **k):
        pass


class _Ctx:
    recorder = _Recorder()
    name = None


class _RankCtx:
    """A data-parallel rank's context, with a fake group: `exchange` is an all-gather between the
    threads that run the ranks (in place of gloo)."""

    def __init__(self, rank, group):
        self.rank, self.world_size, self.group = rank, group.n, group
        self.recorder, self.name, self.policy_version = _Recorder(), "node", 0


class _Group:
    def __init__(self, n):
        self.n, self.barrier, self.slots = n, threading.Barrier(n, timeout=10), [None] * n

    def exchange(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


@pytest.fixture
def fake_collectives(monkeypatch):
    monkeypatch.setattr(N, "all_reduce_sum", lambda ctx, v: sum(ctx.group.exchange(ctx.rank, v)))
    monkeypatch.setattr(N, "all_gather_ints", lambda ctx, vals: ctx.group.exchange(ctx.rank, list(vals)))


def on_ranks(objs, fn):
    """`fn(rank, obj)` on every rank at once (each in its own thread, as the processes would)."""
    out, errors = [None] * len(objs), []

    def one(r):
        try:
            out[r] = fn(r, objs[r])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(objs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


def run_in_process(shape, batch_id=lambda i: f"t-{i:06d}"):
    """The shape's node classes called directly, ticket by ticket: what a perfect runtime does
    (a replace drop that reaches a sink adds a ticket, at most `steps` in all). A data-parallel node
    runs as that many objects, each given its shard by the runtime's own split (`split_groups`) and
    merged back by its `merge_outputs`, in threads with a fake collective (`fake_collectives`)."""
    import flowrl
    from flowrl.runtime.worker.ranks import merge_outputs, split_groups

    objs, ranked = {}, {}
    for d in shape.nodes.values():
        cls = getattr(N, d.cls)
        config = {k: v for k, v in d.config.items() if k != "linger_s"}  # one call at a time here: no wait
        if d.ranks > 1:
            group = _Group(d.ranks)
            ranked[d.name] = [cls(cls.Config.model_validate(config), _RankCtx(r, group)) for r in range(d.ranks)]
            on_ranks(ranked[d.name], lambda r, o: asyncio.run(o.setup()))
            continue
        objs[d.name] = cls(cls.Config.model_validate(config), _Ctx())
        asyncio.run(objs[d.name].setup())
    outcomes = {s: {} for s in shape.sinks}
    per = shape.tickets_per_update
    updates = {d.name: [] for d in shape.nodes.values() if per > 1 and d.sink and d.stateful}
    """`ticket: group`: a stateful sink's live batches of the update so far (one call per update, as
    `DataPath.run_update` makes it: the batches concatenated, the last ticket's id and index)."""

    def call(d, batch):
        if d.ranks > 1:
            shards = split_groups(batch, d.ranks)
            res = on_ranks(ranked[d.name], lambda r, o: asyncio.run(o.process(shards[r], "in")))
            return None if d.sink else merge_outputs(res)
        return asyncio.run(objs[d.name].process(batch, "in"))

    replaced, i = 0, 0
    while i < shape.tickets + replaced:
        out, asks = {}, False
        for d in shape.nodes.values():
            node = objs.get(d.name)
            ins = {p: out[src] for p, src in d.inputs.items()}
            drops = [b for b in ins.values() if isinstance(b, flowrl.Drop)]
            if drops:
                out[d.name] = next((b for b in drops if b.replace), drops[0])
                if d.sink:
                    outcomes[d.name][i] = "dropped"
                    asks |= out[d.name].replace
                continue
            if d.name in updates:
                updates[d.name].append(ins["in"])
                res = None
            elif d.cls == "TicketSource":
                ticket = flowrl.Ticket(batch_id=batch_id(i), index=i, attempt=0, min_policy_version=0,
                                       size=shape.ticket_size)
                res = asyncio.run(node.generate(ticket)).replace(batch_id=batch_id(i), index=i)
            elif d.cls == "Merge":
                res = asyncio.run(node.join(ins))
            else:
                res = call(d, ins["in"])
            if res is None:
                res = flowrl.Drop("returned None")
            if d.sink:
                outcomes[d.name][i] = "consumed"
            out[d.name] = res
        replaced += asks and replaced < shape.steps
        if updates and (i % per == per - 1 or i + 1 == shape.tickets + replaced):
            for name, live in updates.items():
                if live:
                    batch = live[0] if len(live) == 1 else flowrl.Batch.concat(live, batch_id=batch_id(i), index=i)
                    call(shape.nodes[name], batch)
                updates[name] = []
        i += 1
    states = {n: objs[n].state_dict() for n in shape.stateful if n in objs}
    for n, ranks in ranked.items():
        if shape.nodes[n].stateful:  # saving is a collective too
            for r, state in enumerate(on_ranks(ranks, lambda r, o: o.state_dict())):
                states[N.rank_state_key(n, r)] = state
    return states, outcomes


@pytest.mark.parametrize("seed", range(40))
def test_synthetic_nodes_run_in_process_give_exactly_the_models_states_and_outcomes(seed, fake_collectives):
    for shape in (random_shape(seed), random_shape(seed, holds=True), random_shape(seed, ranks=True),
                  random_shape(seed, ranks=True, holds=True, scale=True), random_shape(seed, groups=True),
                  random_shape(seed, ranks=True, groups=True)):
        states, outcomes = run_in_process(shape)
        expected = simulate(shape)
        assert states == expected.states
        assert outcomes == expected.outcomes  # over every ticket, the added ones too
        assert all(len(o) == expected.total for o in outcomes.values())


def test_every_generated_shape_is_a_graph_that_loads_and_passes_the_structure_checks():
    for seed in range(60):
        shape = random_shape(seed)
        spec = load_graph_text(dump_graph(shape.graph(FEATURES)), f"shape{seed}.yaml")
        assert set(spec.nodes) == set(shape.running)  # a fused node runs in its host's process
        assert {f: h for h, n in spec.nodes.items() for f in n.fused} == {
            n: _host(shape, n) for n, d in shape.nodes.items() if d.fuse_into}
        assert 3 <= len(shape.nodes) <= 8 and 1 <= len(shape.sinks) <= 3
        ports = [(e.dst, e.dst_port) for e in spec.edges]
        assert len(ports) == len(set(ports)), "every input port has exactly one edge"


def _host(shape, name: str) -> str:
    while shape.nodes[name].fuse_into:
        name = shape.nodes[name].fuse_into
    return name


def test_fused_shapes_fault_only_processes_and_fuse_only_where_the_graph_check_allows():
    fused = 0
    for seed in range(80):
        shape = random_shape(seed)
        fused += "fused" in shape.traits()
        expected = simulate(shape)
        for k in range(3):
            for f in random_schedule(shape, expected, k, Features.all()).faults:
                target = f.split(":", 1)[1].split("@")[0].split("/")[0].split(",")[0]
                assert shape.nodes[target].fuse_into is None, (seed, f)
        assert not [n for n, d in random_shape(seed, fusion=False).nodes.items() if d.fuse_into]
    assert 8 <= fused <= 40, f"{fused} of 80 shapes with fused nodes"
    assert all("fused" in random_shape(seed, fusion=True).traits() or not _fusable(random_shape(seed, fusion=False))
               for seed in range(40))


def _fusable(shape) -> bool:
    from flowrl.testing.chaos.shapes import FUSABLE

    return any(d.cls in FUSABLE and d.replicas == 1 and d.concurrency == 1 and len(d.inputs) == 1
               and shape.consumers(next(iter(d.inputs.values()))) == [n] and not shape.nodes[next(iter(d.inputs.values()))].sink
               and shape.nodes[next(iter(d.inputs.values()))].ranks == 1
               for n, d in shape.nodes.items())


def test_generators_cover_every_node_kind_and_fault_kind_and_repeat_for_a_seed():
    classes, kinds = set(), set()
    for seed in range(80):
        shape = random_shape(seed)
        classes |= {d.cls for d in shape.nodes.values()}
        classes |= {"replicas"} if any(d.replicas > 1 for d in shape.nodes.values()) else set()
        classes |= {"fan-out"} if any(len(shape.consumers(n)) > 1 for n in shape.nodes) else set()
        for k in range(3):
            kinds |= set(random_schedule(shape, simulate(shape), k, Features.all()).kinds)
    assert classes >= {"TicketSource", "Mix", "Fold", "Drop", "Shrink", "Merge", "FoldSink", "LogSink",
                       "replicas", "fan-out"}
    assert kinds == {"kill", "double_kill", "kill_commit", "sigstop", "stall", "drop_message", "corrupt", "poison"}
    a, b = random_shape(5), random_shape(5)
    assert a.describe() == b.describe()
    assert (random_schedule(a, simulate(a), 1, FEATURES).faults == random_schedule(b, simulate(b), 1, FEATURES).faults)


def test_the_ci_set_has_every_shape_trait_and_every_fault_kind():
    traits, kinds = set(), set()
    for shape, _ in PLAN:
        traits |= set(shape.traits())
        for k in range(PER_SHAPE):
            kinds |= set(random_schedule(shape, simulate(shape), k, Features.all()).kinds)
    assert traits >= {"join", "fan-out", "several sinks", "stateless sink", "replicated sink", "stateful transform",
                      "drops", "shrinks", "replicas", "ragged", "concurrent", "fused"}
    for shape, scheds in GROUP_PLAN:
        assert {"groups", "concurrent"} <= set(shape.traits()) and shape.max_staleness >= 1
        assert any(shape.nodes[n].concurrency > 1 for s in scheds for n in _killed(s)), "a concurrent node killed"
        assert any(shape.nodes[n].stateful and shape.nodes[n].sink for s in scheds for n in _killed(s)), \
            "a stateful sink of a group shape killed"
    assert kinds == {"kill", "double_kill", "kill_commit", "sigstop", "stall", "drop_message", "corrupt", "poison"}
    assert len(SCHEDULES) >= 30
    for name, plan_ in (("shapes", PLAN), ("holds", HOLD_PLAN), ("ranks", RANK_PLAN)):  # ragged and not, in each
        assert {shape.ragged for shape, _ in plan_} == {True, False} or name == "ranks", name
        assert any(shape.ragged for shape, _ in plan_), name
    ragged = {t for shape, _ in PLAN + HOLD_PLAN + RANK_PLAN if shape.ragged for t in shape.traits()}
    assert ragged >= {"join", "shrinks", "stateful transform", "stateless sink", "replaced tickets", "data parallel",
                      "weight sync"}, "ragged batches through joins, selects, held tickets and shards"
    assert any(shape.ragged and shape.nodes[s].ranks == 3 for shape, _ in RANK_PLAN for s in shape.stateful), \
        "a ragged batch in token-balanced shards of a data-parallel stateful node"


def _killed(schedule) -> list[str]:
    return [f.split(":", 1)[1].split("@")[0].split("/")[0] for f in schedule.faults if f.startswith("kill:")]


def test_group_shapes_fold_an_update_in_one_call_and_checkpoint_between_updates():
    for seed in range(60):
        shape = random_shape(seed, groups=True)
        if not shape.groups:
            assert "groups" not in shape.traits()
            continue
        spec = load_graph_text(dump_graph(shape.graph(FEATURES)), f"shape{seed}.yaml")
        assert spec.schedule.ticket == "group" and spec.schedule.total_tickets == shape.tickets
        assert spec.schedule.checkpoint_every_tickets == shape.checkpoint_tickets
        expected = simulate(shape)
        for name in shape.sinks:
            d = shape.nodes[name]
            if d.stateful:
                assert d.config["per_update"] == shape.batch_size
                updates = sorted({i // shape.batch_size for i in expected.reached[name]})
                assert expected.states[N.rank_state_key(name, 0)]["indices"] == updates, "one fold per update"
                assert expected.calls[name] == [u * shape.batch_size for u in updates]
    assert not random_shape(5, holds=True, groups=True).groups or \
        not any(d.cls == "Hold" for d in random_shape(5, holds=True, groups=True).nodes.values())


def test_the_ledger_check_counts_per_ticket_and_sink_and_honours_rollbacks_and_drops():
    rows = [{"event": "issued", "batch_id": "t-000000", "index": 0, "attempt": 0},
            {"event": "issued", "batch_id": "t-000001", "index": 1, "attempt": 0},
            {"event": "consumed", "batch_id": "t-000000", "node": "a/0/0"},
            {"event": "consumed", "batch_id": "t-000000", "node": "b"},
            {"event": "consumed", "batch_id": "t-000001", "node": "a"},
            {"event": "rolled_back", "batch_id": "t-000001", "node": "a"},
            {"event": "consumed", "batch_id": "t-000001", "node": "a"},
            {"event": "consumed", "batch_id": "t-000001", "node": "a"},
            {"event": "dropped", "batch_id": "t-000001", "node": "b", "by": "f"}]
    got = check_ledger(rows, ["a", "b"], steps=2)
    assert got.duplicated == ["t-000001@a x2"] and not got.lost and not got.not_issued
    got = check_ledger(rows[:5], ["a", "b"], steps=3)
    assert got.lost == ["t-000001@b"] and got.not_issued == [2]


def test_the_state_check_says_which_tickets_were_lost_or_folded_twice():
    want = {"chain": N.EMPTY_CHAIN, "count": 6, "indices": [0, 1, 2, 3, 4, 5]}
    got = {"chain": "ff" * 16, "count": 5, "indices": [0, 1, 3, 3, 5]}
    diff = compare_state("norm", got, want)
    assert "missing tickets 2, 4" in diff and "folded twice 3" in diff
    assert compare_state("norm", dict(want), want) is None


def test_a_fold_is_order_dependent_so_a_reordering_is_a_mismatch():
    x, y = np.arange(3), np.arange(3) + 1
    ab = N.fold_state(N.fold_state(N.EMPTY_CHAIN, "t-0", x), "t-1", y)
    ba = N.fold_state(N.fold_state(N.EMPTY_CHAIN, "t-1", y), "t-0", x)
    assert ab != ba


def test_without_the_new_options_every_seed_gives_the_shapes_and_schedules_it_always_gave():
    """`ranks`, `scale`, `groups` (and `holds`) are opt-in: older campaigns' seeds stay comparable.
    Half the shapes are now ragged, and half have concurrent nodes (draws of their own): their graphs
    and schedules are the ones they were. Fused nodes change which processes faults can target, so
    this holds with `fusion=False` (tested above: faults then target the hosts)."""
    import re

    from flowrl.testing.chaos.shapes import RAGGED_MARK

    h, ragged, concurrent = hashlib.sha256(), 0, 0
    for seed in range(40):
        for kw in ({"fusion": False}, {"holds": True, "fusion": False}):
            shape = random_shape(seed, **kw)
            ragged += shape.ragged
            concurrent += "concurrent" in shape.traits()
            h.update(re.sub(r" ~\d+", "", shape.describe().replace(RAGGED_MARK, "")).encode())
            expected = simulate(shape)
            for k in range(3):
                h.update(random_schedule(shape, expected, k, Features.all()).describe().encode())
    assert h.hexdigest() == "447ea8490f4728ddf89ca60eb92728f8971dc543926aee44d94458a1422abfcd"
    assert 25 <= ragged <= 55, f"{ragged} of 80 shapes ragged"
    assert 25 <= concurrent <= 55, f"{concurrent} of 80 shapes with concurrent nodes"


def test_rank_shapes_have_data_parallel_nodes_where_the_runtime_allows_them_and_a_subscriber_per_trainer():
    from flowrl.graph import node_classes

    seen = set()
    for seed in range(60):
        shape = random_shape(seed, ranks=True, scale=True)
        spec = load_graph_text(dump_graph(shape.graph(FEATURES)), f"shape{seed}.yaml")
        classes = node_classes(spec)
        ranked = [d for d in shape.nodes.values() if d.ranks > 1]
        assert ranked, "every rank shape has a data-parallel node"
        for d in ranked:
            cls = classes[d.name]
            assert 2 <= d.ranks <= 3 and d.replicas == 1 and spec.nodes[d.name].devices == d.ranks
            assert cls.inputs == ("in",) and len(cls.outputs) <= 1, "dp: transforms or sinks with one output port"
        assert shape.processes <= 10
        trainers = [d.name for d in shape.nodes.values() if d.cls == "RTrainer"]
        subs = [d.name for d in shape.nodes.values() if d.cls in ("Sub", "RSub")]
        assert bool(trainers) == bool(subs) and len(trainers) <= 1
        assert sorted(f"{w.src} -> {w.dst}" for w in spec.weights) == sorted(f"{t} -> {s}" for t in trainers for s in subs)
        assert shape.scalable and shape.pace_s > 0 and shape.steps >= 20
        assert set(shape.state_keys) == set(simulate(shape).states)
        seen |= {d.cls for d in shape.nodes.values()}
    assert seen >= {"RMix", "RFold", "RFoldSink", "RTrainer", "Sub", "RSub"}


def test_a_trainers_weights_are_gathered_from_every_rank_and_a_version_that_is_not_whole_is_named(fake_collectives):
    group = _Group(3)
    ranks = [N.RTrainer(N.RTrainer.Config(), _RankCtx(r, group)) for r in range(3)]
    on_ranks(ranks, lambda r, o: asyncio.run(o.setup()))
    for o in ranks:
        o.ctx.policy_version, o.count = 4, 7
    layout = dict(ranks[0].weights().items())
    assert list(layout) == ["w"] and tuple(layout["w"].shape) == (N.PART * 3,)
    got = on_ranks(ranks, lambda r, o: o.weights()["w"].tolist() if r == 0 else o.weights().drain())[0]
    assert N.weight_problem(got, 4, 3) is None
    assert "versions [4, 4, 4]" in N.weight_problem(got, 5, 3)  # the label says 5, every part 4
    ranks[2].ctx.policy_version = 3  # a rank that published at another point than its leader
    got = on_ranks(ranks, lambda r, o: o.weights()["w"].tolist() if r == 0 else o.weights().drain())[0]
    assert "versions [4, 4, 3]" in N.weight_problem(got, 4, 3)


def test_rank_states_are_checked_per_rank_and_a_save_at_different_tickets_is_named():
    from flowrl.testing.chaos.check import state_key

    assert [state_key(p) for p in ("sink/0/0", "sink/0/2", "fold/0/0")] == ["sink", "sink/rank2", "fold"]
    want = {"chain": N.EMPTY_CHAIN, "count": 2, "indices": [0, 1], "counts": [2, 2]}
    assert compare_state("sink/rank1", dict(want), want) is None
    diff = compare_state("sink/rank1", {**want, "counts": [2, 1]}, want)
    assert diff.startswith("sink/rank1: saved when its ranks had folded [2, 1] tickets")


def test_rank_bounds_are_the_runtimes_token_balanced_split_of_a_ragged_batch():
    """The model's shard bounds (`rank_bounds`) must be the runtime's (`split_groups`): by count
    without `r`, by tokens with it, empty shards included."""
    from flowrl.runtime.worker.ranks import split_groups

    rng = np.random.default_rng(0)
    differ = 0
    for _ in range(300):
        n, parts = int(rng.integers(0, 12)), int(rng.integers(2, 4))
        x = rng.integers(0, N.MOD, size=n, dtype=np.int64)
        lengths = N.ragged_lengths(x)
        for batch, lens in ((flowrl.Batch(tensors={"x": x, "r": N.ragged_of(x, lengths)}), lengths),
                            (flowrl.Batch(tensors={"x": x}), None)):
            got, start = [], 0
            for shard in split_groups(batch, parts):
                got.append((start, start + shard.num_samples))
                start += shard.num_samples
                assert N.ragged_problem(shard, lens is not None) is None
            assert N.rank_bounds(n, parts, lens) == got, (n, parts, lens)
        differ += N.rank_bounds(n, parts, lengths) != N.rank_bounds(n, parts)
    assert differ > 30, "tokens, not counts, decide the shards of many ragged batches"


def _ragged_batch(ix=3, size=6, seed=11):
    src = N.TicketSource(N.TicketSource.Config(seed=seed, ragged=True), _Ctx())
    ticket = flowrl.Ticket(batch_id=f"t-{ix:06d}", index=ix, attempt=0, min_policy_version=0, size=size)
    return asyncio.run(src.generate(ticket)).replace(batch_id=f"t-{ix:06d}")


def test_ragged_batches_keep_r_aligned_with_x_through_every_synthetic_node_and_the_codec(fake_collectives):
    from flowrl.runtime.worker.ranks import merge_outputs, split_groups
    from flowrl.transport import codec

    b = _ragged_batch()
    x = np.asarray(b.tensors["x"])
    assert N.lengths_of(b).tolist() == (1 + x % 7).tolist() and len(set(N.lengths_of(b).tolist())) > 1
    assert N.ragged_problem(b, True) is None

    def run(cls, batch, **config):
        node = cls(cls.Config(**config), _Ctx())
        asyncio.run(node.setup())
        out = asyncio.run(node.process(batch, "in"))
        assert N.ragged_problem(out, True) is None, cls.__name__
        return out, node

    mixed, _ = run(N.Mix, b, mul=5, add=3)
    assert N.lengths_of(mixed).tolist() == N.lengths_of(b).tolist()
    assert np.array_equal(np.asarray(mixed.tensors["x"]), N.mix_values(x, 5, 3))
    shrunk, _ = run(N.Shrink, codec.decode(codec.encode(mixed)), seed=4)  # read-only values off the wire
    keep = N.shrink_mask(np.asarray(mixed.tensors["x"]), 4)
    assert 0 < shrunk.num_samples < b.num_samples and N.lengths_of(shrunk).tolist() == N.lengths_of(b)[keep].tolist()
    merged = asyncio.run(N.Merge(N.Merge.Config(), _Ctx()).join({"a": shrunk, "b": mixed}))
    assert N.ragged_problem(merged, True) is None and merged.num_samples == shrunk.num_samples + b.num_samples
    hold = N.Hold(N.Hold.Config(rate=1.0, max_held=1, ragged=True), _Ctx())  # holds the first, not the next
    asyncio.run(hold.setup())
    assert isinstance(asyncio.run(hold.process(merged, "in")), flowrl.Drop)
    state = hold.state_dict()
    assert state["lengths"] == [N.lengths_of(merged).tolist()] and all(type(v) is int for v in state["lengths"][0])
    hold.load_state_dict(state)  # as after a restart
    released = asyncio.run(hold.process(b, "in"))
    assert N.ragged_problem(released, True) is None
    assert N.lengths_of(released).tolist() == N.lengths_of(merged).tolist() + N.lengths_of(b).tolist()
    group = _Group(3)  # RMix on 3 ranks: the runtime's token-balanced shards, merged back in rank order
    ranks = [N.RMix(N.RMix.Config(mul=7, add=1), _RankCtx(r, group)) for r in range(3)]
    shards = split_groups(released, 3)
    outs = on_ranks(ranks, lambda r, o: asyncio.run(o.process(shards[r], "in")))
    whole = merge_outputs(outs)
    assert N.ragged_problem(whole, True) is None
    assert np.array_equal(np.asarray(whole.tensors["x"]), N.rmix_values(np.asarray(released.tensors["x"]), 7, 1))
    assert N.lengths_of(whole).tolist() == N.lengths_of(released).tolist()
    sink, _ = N.FoldSink(N.FoldSink.Config(ragged=True), _Ctx()), None
    asyncio.run(sink.setup())
    asyncio.run(sink.process(whole, "in"))
    assert sink.chain == N.fold_state(N.EMPTY_CHAIN, whole.batch_id, np.asarray(whole.tensors["x"]),
                                      N.lengths_of(whole))
    assert sink.chain != N.fold_state(N.EMPTY_CHAIN, whole.batch_id, np.asarray(whole.tensors["x"])), \
        "the chain folds r's lengths"


def _corrupt(batch, values=None, offsets=None):
    """`batch` with `r` given other values or offsets, past the Batch's own checks."""
    r = batch.tensors["r"]
    bad = flowrl.Ragged(r.values if values is None else values, r.offsets if offsets is None else offsets,
                        check=False)
    out = batch.replace()
    object.__setattr__(out, "tensors", {**batch.tensors, "r": bad})
    return out


@pytest.mark.parametrize("cls", ["FoldSink", "Fold", "LogSink", "Hold", "RFoldSink"])
def test_a_stateful_node_or_sink_fails_loudly_naming_itself_and_the_batch_on_a_corrupted_r(cls, fake_collectives):
    b = _ragged_batch(ix=5, size=5)
    r = b.tensors["r"]
    lengths = N.lengths_of(b)
    values = np.array(r.values)
    values[int(r.offsets[2])] += 1  # a token of sample 2
    shifted = np.array(r.offsets)
    shifted[1:-1] += 1  # every sample but the last one longer, the last shorter: the values no longer fit
    short = flowrl.Ragged.from_sequences(list(r)[:-1], lib="numpy")
    cases = {
        "sample 2 differs": _corrupt(b, values=values),
        "not x repeated": _corrupt(b, offsets=shifted),
        "has 4 samples, 'x' 5": _corrupt(b, values=short.values, offsets=short.offsets),
        "bad offsets": _corrupt(b, offsets=np.array(r.offsets)[::-1].copy()),
        "each must be 1..7": _corrupt(b, values=np.repeat(np.asarray(b.tensors["x"]), lengths + 7),
                                      offsets=np.concatenate([[0], np.cumsum(lengths + 7)]).astype(np.int64)),
        "no ragged tensor 'r'": b.replace(tensors={"x": b.tensors["x"]}),
    }
    node_cls = getattr(N, cls)
    ctx = _RankCtx(0, _Group(1)) if cls.startswith("R") else _Ctx()
    ctx.name = "checker"
    node = node_cls(node_cls.Config(ragged=True), ctx)
    asyncio.run(node.setup())
    asyncio.run(node.process(b, "in"))  # a good one passes
    for why, bad in cases.items():
        with pytest.raises(N.RaggedMismatch, match=rf"node 'checker': batch t-000005 \(ticket 5.*{why}"):
            asyncio.run(node.process(bad, "in"))
    assert N.ragged_problem(b.replace(tensors={"x": b.tensors["x"]})) is None, "not required: no r is fine"


def test_scale_schedules_scale_a_stateless_node_up_then_down_and_kill_a_replica_just_added():
    from flowrl.testing.chaos.trial import ScaleEvent

    kinds = set()
    for seed in range(30):
        shape = random_shape(seed, ranks=True, scale=True)
        expected = simulate(shape)
        for k in range(3):
            sched = random_schedule(shape, expected, k, FEATURES, scale=True)
            kinds |= set(sched.kinds)
            up, down = (ScaleEvent.parse(x) for x in sched.scales)
            node = shape.nodes[up.node]
            assert up.node == down.node and node.scalable and node.ranks == 1
            assert node.replicas < up.replicas <= 3 and 1 <= down.replicas < up.replicas
            assert 1 <= up.completed < down.completed <= expected.total
            if sched.kinds[0] == "scale_kill":
                killed = next(f for f in sched.faults if f.startswith(f"kill:{up.node}/"))
                replica = int(killed.split("/")[1].split("@")[0])
                assert node.replicas <= replica < up.replicas, "a replica the scale-up added"
                assert down.after == f"{up.node}/{replica}" and down.replicas <= replica, "the scale-down removes it"
            for f in sched.faults:  # a rank is named only on a data-parallel node
                target = f.split(":", 1)[1].split("@")[0].split("/")
                if len(target) == 3:
                    assert shape.nodes[target[0]].ranks > int(target[2])
    assert kinds >= {"scale", "scale_kill", "kill_rank"}


def test_the_scaler_asks_at_observed_progress_and_again_while_the_run_recovers(tmp_path, monkeypatch):
    from flowrl.runtime.controller import scaling
    from flowrl.testing.chaos.trial import Scaler

    asked, answers = [], ["the run is recovering from a failure; try again in a moment"]

    def request(run_dir, node, replicas, timeout_s):
        asked.append((node, replicas))
        if answers:
            raise scaling.ScaleError(answers.pop())
        return f"{node}: -> {replicas} replica(s)"

    monkeypatch.setattr(scaling, "request", request)
    (tmp_path / "logs").mkdir()
    ledger = tmp_path / "ledger.jsonl"
    scaler = Scaler(tmp_path, ["scale:sub=3@completed=2", "scale:sub=1@completed=3,after=sub/2"])
    scaler.RETRY_S = 0.01

    def rows(*events):
        with open(ledger, "a") as f:
            for e in events:
                f.write(json.dumps(e) + "\n")

    def settle():
        for _ in range(200):
            scaler.poll()
            if scaler.thread is None or not scaler.thread.is_alive():
                scaler.poll()
                return
            threading.Event().wait(0.01)

    rows({"event": "completed"})
    settle()
    assert asked == []
    rows({"event": "completed"})
    settle()
    assert asked == [("sub", 3), ("sub", 3)]  # refused while recovering, asked again
    rows({"event": "completed"}, {"event": "completed"})
    settle()
    assert len(asked) == 2, "the scale-down waits for sub/2 to go down and come back"
    rows({"event": "node_down", "node": "sub/2/0"})
    (tmp_path / "logs" / "sub.2.0.log").write_text("x INFO flowrl.worker: ready 0.08 s after start (incarnation 1)\n")
    settle()
    scaler.finish()
    assert asked[-1] == ("sub", 1)
    assert [o.split(": fired")[0] for o in scaler.outcomes] == ["scale:sub=3@completed=2",
                                                               "scale:sub=1@completed=3,after=sub/2"]
    assert not scaler.errors


def test_a_hang_is_told_by_where_each_main_loop_waits():
    from flowrl.testing.harness import _where

    lib = "wrapper (_asyncio.py:1) -> run_node (worker.py:2) -> main_loop (worker.py:3)"
    assert _where(lib + " -> receive (memory.py:4) -> wait (locks.py:5) -> waits on FutureIter") == \
        "idle (waiting for the next event)"
    assert _where(lib + " -> on_arrival (datapath.py:6) -> run (datapath.py:7) -> run_ranks (ranks.py:8) -> "
                  "gather (ranks.py:9) -> recv (receiver.py:10) -> wait (locks.py:11)") == \
        "in on_arrival > run > run_ranks > gather > recv"


def test_a_rank_left_inside_a_collective_is_named_with_its_call_chain(tmp_path):
    from flowrl.testing.chaos.trial import collective_waits

    (tmp_path / "logs").mkdir()
    frames = ["run_node", "main_loop", "on_arrival", "run", "consume", "publish_snapshot", "__getitem__",
              "all_gather_ints", "wrapper", "all_gather"]
    tb = "\n".join(f'  File "/x/{fn}.py", line 1, in {fn}\n    code()' for fn in frames)
    (tmp_path / "logs" / "trainer.0.0.log").write_text(
        "x INFO ready\nTraceback (most recent call last):\n" + tb + "\nRuntimeError: Connection closed by peer\n")
    (tmp_path / "logs" / "sub.0.0.log").write_text(
        'Traceback (most recent call last):\n  File "/x/a.py", line 1, in main_loop\nValueError: other\n')
    assert collective_waits(tmp_path) == [
        "trainer/0/0: main_loop > on_arrival > run > consume > publish_snapshot > __getitem__ > all_gather_ints > "
        "wrapper > all_gather"]


# --- real runs ----------------------------------------------------------------------------------

def run_campaign(tmp_path_factory, name: str, seeds, per_shape: int, **kw) -> dict:
    """Every shape fault-free, then under each of its schedules; a few runs at a time. Results by
    (shape seed, schedule id)."""
    jobs = int(os.environ.get("FLOWRL_CHAOS_JOBS", "2"))
    results = campaign(seeds, per_shape, tmp_path_factory.mktemp(name), jobs=jobs, features=FEATURES, **kw)
    return {(r.shape, r.schedule): r for r in results}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_campaign(tmp_path_factory, "shapes", SHAPE_SEEDS, PER_SHAPE, **SMALL)


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", SHAPE_SEEDS, ids=[f"shape{s}" for s in SHAPE_SEEDS])
def test_fault_free_run_of_a_random_shape_completes_with_the_models_ledger_and_states(runs, seed):
    res = runs[(seed, "ref")]
    assert res.ok, res.explain(SHAPES[seed])


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s.id for s in SCHEDULES])
def test_random_faults_on_a_random_shape_keep_exactly_once_and_state_or_fail_naming_the_culprit(runs, schedule):
    res = runs[(schedule.shape_seed, schedule.id)]
    assert res.ok, res.explain(SHAPES[schedule.shape_seed])


@pytest.fixture(scope="module")
def hold_runs(tmp_path_factory):
    return run_campaign(tmp_path_factory, "holds", HOLD_SEEDS, HOLD_PER_SHAPE, holds=True, **SMALL)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("schedule", ["ref", *HOLD_SCHEDULES],
                         ids=["ref"] + [s.id for s in HOLD_SCHEDULES])
def test_shapes_whose_tickets_are_held_and_replaced_keep_exactly_once_under_faults(hold_runs, schedule):
    for seed in HOLD_SEEDS if schedule == "ref" else [schedule.shape_seed]:
        shape = dict((sh.seed, sh) for sh, _ in HOLD_PLAN)[seed]
        assert "replaced tickets" in shape.traits() and simulate(shape).total > shape.steps
        res = hold_runs[(seed, "ref" if schedule == "ref" else schedule.id)]
        assert res.ok, res.explain(shape)


def test_the_time_bound_comes_from_the_graphs_own_timeouts():
    from flowrl.testing.chaos import bound_s

    shape = random_shape(0)
    t = shape.timing
    detect = max(t.deadline_s, t.process_timeout_s) + t.heartbeat_s + 0.5
    stuck = (t.max_attempts + 1) * (t.ticket_timeout_s + detect)
    assert bound_s(shape, 0, 5.0) == pytest.approx(2 * 5.0 + 10 + stuck)
    one_fault = bound_s(shape, 1, 5.0) - bound_s(shape, 0, 5.0)
    assert one_fault == pytest.approx(detect + t.backoff_s * 2 ** t.max_restarts + 5)
    t.ticket_timeout_s *= 2
    assert bound_s(shape, 0, 5.0) > 2 * 5.0 + 10 + stuck, "a longer ticket timeout widens the bound"


@pytest.fixture(scope="module")
def group_runs(tmp_path_factory):
    return run_campaign(tmp_path_factory, "groups", GROUP_SEEDS, GROUP_PER_SHAPE, extra=GROUP_EXTRA, **GROUP_KW)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["ref", *GROUP_SCHEDULES], ids=["ref"] + [s.id for s in GROUP_SCHEDULES])
def test_group_tickets_and_concurrent_calls_keep_exactly_once_and_state_under_faults(group_runs, schedule):
    """A stateful sink takes the tickets of an update in one call (their batches concatenated) and a
    concurrent node's calls overlap; a kill of either must still leave every ticket consumed once and
    every state equal to the fault-free run's (itself equal to the model's)."""
    shapes = {sh.seed: sh for sh, _ in GROUP_PLAN}
    for seed in GROUP_SEEDS if schedule == "ref" else [schedule.shape_seed]:
        shape = shapes[seed]
        res = group_runs[(seed, "ref" if schedule == "ref" else schedule.id)]
        assert res.ok, res.explain(shape)
        if schedule == "ref":
            assert max(res.overlap.values()) >= 2, f"calls of {res.overlap} never overlapped\n{res.explain(shape)}"
        elif schedule.seed == 100:  # the kills by hand hit live nodes
            assert res.restarts >= 2, res.explain(shape)


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory):
    return run_campaign(tmp_path_factory, "ranks", RANK_SEEDS, RANK_PER_SHAPE, **RANK_KW)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("schedule", ["ref", *RANK_SCHEDULES], ids=["ref"] + [s.id for s in RANK_SCHEDULES])
def test_data_parallel_collectives_weight_publishing_and_scale_events_keep_the_contract(rank_runs, schedule):
    """A hang here (a collective some rank never reaches, a weight sync that waits for a replica
    scaled away) is a failure: the result lists where each process waited when it was killed."""
    shapes = {sh.seed: sh for sh, _ in RANK_PLAN}
    for seed in RANK_SEEDS if schedule == "ref" else [schedule.shape_seed]:
        shape = shapes[seed]
        assert {"data parallel", "weight sync"} <= set(shape.traits())
        res = rank_runs[(seed, "ref" if schedule == "ref" else schedule.id)]
        assert res.ok, res.explain(shape)
        if schedule != "ref":
            assert res.scales_fired >= 1, res.explain(shape)
