"""Shape x fault, like Jepsen for this runtime: random DAGs of synthetic nodes (chains, fan-out,
joins, 1-3 sinks, stateful transforms, drops, replicas) under random fault schedules (kill, two
kills in one checkpoint interval, kill during a commit, SIGSTOP, stuck in process, a lost message,
a corrupt frame, a node that hangs in every incarnation).

Every run must end within its time bound, and then either have completed — every ticket consumed
or dropped once by every sink, every stateful node's final state bitwise equal to the model's (and
so to a fault-free run's) — or, for a schedule the runtime cannot recover from, have failed with an
error naming the node or the ticket. The fault-free run of each shape is the reference.

    python -m pytest tests/fault/test_shapes.py -q
    FLOWRL_CHAOS_JOBS=1 FLOWRL_CHAOS_HANG_S=40 python -m pytest tests/fault/test_shapes.py -q   # quicker "hung"

The same campaign, larger: `python benchmarks/chaos.py --shapes 300`.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from flowrl.graph import dump_graph
from flowrl.graph.loader import load_graph_text
from flowrl.testing.chaos import (
    Features,
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
SHAPES = {shape.seed: shape for shape, _ in PLAN}
SCHEDULES = [s for _, scheds in PLAN for s in scheds]


# --- the model, the generators and the checker, without processes ----------------------------

class _Recorder:
    def count(self, *a, **k):
        pass


class _Ctx:
    recorder = _Recorder()


def run_in_process(shape, batch_id=lambda i: f"t-{i:06d}"):
    """The shape's node classes called directly, ticket by ticket: what a perfect runtime does
    (a replace drop that reaches a sink adds a ticket, at most `steps` in all)."""
    import flowrl

    objs = {}
    for d in shape.nodes.values():
        cls = getattr(N, d.cls)
        objs[d.name] = cls(cls.Config.model_validate(d.config), _Ctx())
        asyncio.run(objs[d.name].setup())
    outcomes = {s: {} for s in shape.sinks}
    replaced, i = 0, 0
    while i < shape.steps + replaced:
        out, asks = {}, False
        for d in shape.nodes.values():
            node = objs[d.name]
            ins = {p: out[src] for p, src in d.inputs.items()}
            drops = [b for b in ins.values() if isinstance(b, flowrl.Drop)]
            if drops:
                out[d.name] = next((b for b in drops if b.replace), drops[0])
                if d.sink:
                    outcomes[d.name][i] = "dropped"
                    asks |= out[d.name].replace
                continue
            if d.cls == "TicketSource":
                ticket = flowrl.Ticket(batch_id=batch_id(i), index=i, attempt=0, min_policy_version=0,
                                       size=shape.batch_size)
                res = asyncio.run(node.generate(ticket)).replace(batch_id=batch_id(i))
            elif d.cls == "Merge":
                res = asyncio.run(node.join(ins))
            else:
                res = asyncio.run(node.process(ins["in"], "in"))
            if res is None:
                res = flowrl.Drop("returned None")
            if d.sink:
                outcomes[d.name][i] = "consumed"
            out[d.name] = res
        replaced += asks and replaced < shape.steps
        i += 1
    return {n: objs[n].state_dict() for n in shape.stateful}, outcomes


@pytest.mark.parametrize("seed", range(40))
def test_synthetic_nodes_run_in_process_give_exactly_the_models_states_and_outcomes(seed):
    for shape in (random_shape(seed), random_shape(seed, holds=True)):
        states, outcomes = run_in_process(shape)
        expected = simulate(shape)
        assert states == expected.states
        assert outcomes == expected.outcomes  # over every ticket, the added ones too
        assert all(len(o) == expected.total for o in outcomes.values())


def test_every_generated_shape_is_a_graph_that_loads_and_passes_the_structure_checks():
    for seed in range(60):
        shape = random_shape(seed)
        spec = load_graph_text(dump_graph(shape.graph(FEATURES)), f"shape{seed}.yaml")
        assert set(spec.nodes) == set(shape.nodes)
        assert 3 <= len(shape.nodes) <= 8 and 1 <= len(shape.sinks) <= 3
        ports = [(e.dst, e.dst_port) for e in spec.edges]
        assert len(ports) == len(set(ports)), "every input port has exactly one edge"


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
                      "drops", "shrinks", "replicas"}
    assert kinds == {"kill", "double_kill", "kill_commit", "sigstop", "stall", "drop_message", "corrupt", "poison"}
    assert len(SCHEDULES) >= 30


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


# --- real runs ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every shape fault-free, then under each of its schedules; a few runs at a time."""
    jobs = int(os.environ.get("FLOWRL_CHAOS_JOBS", "2"))
    results = campaign(SHAPE_SEEDS, PER_SHAPE, tmp_path_factory.mktemp("shapes"), jobs=jobs, features=FEATURES,
                       **SMALL)
    return {(r.shape, r.schedule): r for r in results}


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
    jobs = int(os.environ.get("FLOWRL_CHAOS_JOBS", "2"))
    results = campaign(HOLD_SEEDS, HOLD_PER_SHAPE, tmp_path_factory.mktemp("holds"), jobs=jobs, features=FEATURES,
                       holds=True, **SMALL)
    return {(r.shape, r.schedule): r for r in results}


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
