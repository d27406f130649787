"""The planner on large hosts and absurd requests: polynomial, bounded, and still sensible.

Its work is counted, not timed: groups picked (one per replica) and, for each search for a group on
one host, the candidate groups scored and the greedy steps taken; flowrl/placement/groups.py bounds
both (EXHAUSTIVE_LIMIT, GREEDY_BUDGET), and a search past its bound fails the test at once. How
long these plans take is measured by benchmarks/check_speed.py."""

import pytest

from flowrl.placement import groups, make_plan, planner

from tests.placement.conftest import codes, graph, inventory, plan_of

TWO_HOSTS = """
hosts:
  - {name: a, address: 10.0.0.1, nvswitch: true, gpu_defaults: {memory_gb: 80, compute_capability: "9.0"},
     gpus: [{id: 0}, {id: 1}, {id: 2}, {id: 3}]}
  - {name: b, address: 10.0.0.2, nvswitch: true, gpu_defaults: {memory_gb: 80, compute_capability: "9.0"},
     gpus: [{id: 0}, {id: 1}, {id: 2}, {id: 3}]}
"""


class Work:
    """What one make_plan did, counted through the functions of flowrl/placement/groups.py."""

    def __init__(self, monkeypatch):
        self.picks = 0  # groups picked: pick_gpus / pick_cores calls
        self.searches = 0  # best_on_host calls: one search among one host's devices
        self.scored = self.steps = 0  # over every search: candidate groups scored, greedy steps (size x devices)
        self.search = None  # [scored, steps] of the search under way
        for name in ("pick_gpus", "pick_cores"):  # the planner calls them by the names it imported
            counted = self.picking(getattr(groups, name))
            monkeypatch.setattr(groups, name, counted)
            monkeypatch.setattr(planner, name, counted)
        monkeypatch.setattr(groups, "best_on_host", self.searching(groups.best_on_host))
        monkeypatch.setattr(groups, "_score", self.scoring(groups._score))
        monkeypatch.setattr(groups, "_grow", self.growing(groups._grow))

    def picking(self, original):
        def pick(*args, **kwargs):
            self.picks += 1
            return original(*args, **kwargs)
        return pick

    def searching(self, original):
        def best_on_host(*args, **kwargs):
            self.searches += 1
            self.search = [0, 0]
            try:
                return original(*args, **kwargs)
            finally:
                self.search = None
        return best_on_host

    def scoring(self, original):
        def score(*args, **kwargs):
            self.scored += 1
            if self.search is not None:
                self.search[0] += 1
                assert self.search[0] <= groups.EXHAUSTIVE_LIMIT, "one search scored more groups than EXHAUSTIVE_LIMIT"
            return original(*args, **kwargs)
        return score

    def growing(self, original):
        def grow(seed, devs, size, *args, **kwargs):
            self.steps += size * len(devs)
            self.search[1] += size * len(devs)
            assert self.search[1] <= groups.GREEDY_BUDGET, "one greedy search took more steps than GREEDY_BUDGET"
            return original(seed, devs, size, *args, **kwargs)
        return grow


@pytest.fixture
def work(monkeypatch):
    return Work(monkeypatch)


def big_host(n: int, nvswitch: bool = True, per_root: int = 8):
    gpus = ", ".join(f"{{id: {i}, pcie_root: r{i // per_root}, numa_node: {i * 2 // n}}}" for i in range(n))
    return inventory(f"hosts: [{{name: h, nvswitch: {str(nvswitch).lower()}, gpu_defaults: {{memory_gb: 80, "
                     f"compute_capability: '9.0'}}, gpus: [{gpus}]}}]")


def test_a_256_gpu_nvswitch_host_plans_within_the_search_budget(work):
    inv = big_host(256)
    spec = graph("  actor: {kind: R:Actor, devices: 64}\n  critic: {kind: R:Critic, devices: 32}\n"
                 "  rollout: {kind: R:Rollout, devices: 8, replicas: 16}\n  reference: {kind: R:Reference, devices: 16}")
    plan = make_plan(spec, inv)
    assert plan.ok and len(plan.entries) == 64 + 32 + 128 + 16
    assert work.picks == 1 + 1 + 16 + 1  # one group per replica, each search within its bound (Work)
    assert work.steps > 0 and work.scored < 20 * work.picks  # greedy: a few seeds per search, not C(256, 64)
    assert len({e.devices[0] for e in plan.entries}) == 240  # disjoint groups


def test_a_72_gpu_host_with_a_32_gpu_actor_plans_within_the_search_budget_and_keeps_the_actor_on_few_roots(work):
    inv = big_host(72, nvswitch=False)
    plan = make_plan(graph("  actor: {kind: R:Actor, devices: 32}\n  critic: {kind: R:Critic, devices: 8}"), inv)
    assert work.picks == 2 and work.steps > 0 and work.scored < 20 * work.picks  # as above
    actor = [e.devices[0] for e in plan.for_node("actor")]
    assert len({d // 8 for d in actor}) == 4  # 32 GPUs on exactly 4 PCIe roots of 8


def test_a_billion_replicas_is_an_error_before_any_group_is_picked_on_gpus_and_on_cpus(work):
    for inv in (big_host(256), "laptop-2cpu.yaml"):
        plan = plan_of("  rollout: {kind: R:Rollout, devices: 1, replicas: 1000000000}", inv)
        assert codes(plan) == {("not-enough-devices", "rollout")} and "1000000000" in plan.errors[0].message
        assert plan.entries == []
    assert (work.picks, work.searches, work.scored) == (0, 0, 0)  # refused from the request, no loop over replicas


def test_a_role_less_helper_with_a_billion_replicas_is_an_error_too():
    plan = plan_of("  helper: {kind: R:Helper, replicas: 1000000000}", "a100x8-nvlink.yaml")
    assert codes(plan) == {("not-enough-devices", "helper")}


def test_on_cpu_the_ranks_of_one_replica_get_distinct_cores_and_the_plan_has_a_row_per_rank():
    plan = plan_of("  actor: {kind: R:Actor, devices: 2}\n  critic: {kind: R:Critic, devices: 2}", "laptop-2cpu.yaml")
    for node in ("actor", "critic"):
        rows = plan.for_node(node)
        assert [e.rank for e in rows] == [0, 1] and sorted(e.devices[0] for e in rows) == [0, 1]


def test_on_cpu_more_ranks_than_cores_cycle_over_the_cores_with_a_note():
    plan = plan_of("  actor: {kind: R:Actor, devices: 3}", "laptop-2cpu.yaml")
    assert plan.ok and [e.rank for e in plan.entries] == [0, 1, 2]
    assert sorted(e.devices[0] for e in plan.entries) == [0, 0, 1]
    assert {f.code for f in plan.findings} == {"cpu-shared"}


def test_time_shared_cores_are_one_note_not_one_per_core():
    plan = plan_of("".join(f"  n{i}: {{kind: R:Helper}}\n" for i in range(6)), "laptop-2cpu.yaml")
    (note,) = plan.findings
    assert note.code == "cpu-shared" and note.devices == (0, 1)


def test_a_weight_subscriber_is_placed_on_its_trainers_host():
    pcie = TWO_HOSTS.replace("nvswitch: true", "nvswitch: false")
    nodes = '  trainer: {kind: R:Trainer, devices: ["b:0", "b:1"]}\n  gen: {kind: R:Subscriber, devices: 1}'
    assert plan_of(nodes, pcie, "weights: [trainer -> gen]").for_node("gen")[0].host == "b"
    assert plan_of(nodes, pcie, "").for_node("gen")[0].host == "a"  # without the weight edge the first host wins


def test_a_weight_subscriber_prefers_gpus_with_nvlink_to_its_trainer():
    inv = inventory("""
hosts:
  - name: h
    gpu_defaults: {memory_gb: 80, compute_capability: "9.0", pcie_root: r0}
    gpus: [{id: 0, nvlink: [3]}, {id: 1}, {id: 2}, {id: 3, nvlink: [0]}]
""")
    plan = make_plan(graph("  trainer: {kind: R:Trainer, devices: [0]}\n  gen: {kind: R:Subscriber, devices: 1}",
                           "weights: [trainer -> gen]"), inv)
    assert plan.for_node("gen")[0].devices == [3]


def test_colocate_with_is_transitive_for_a_hybrid_engine(a100):
    nodes = ("  actor: {kind: R:Actor, devices: [0, 1]}\n"
             "  rollout: {kind: R:Rollout, devices: [0, 1], colocate_with: [actor]}\n"
             "  reference: {kind: R:Reference, devices: [0, 1], colocate_with: [rollout]}")
    assert codes(plan_of(nodes, a100)) == set()
    auto = plan_of(nodes.replace("devices: [0, 1], colocate_with", "devices: 2, colocate_with"), a100)
    assert {tuple(e.devices) for e in auto.for_node("reference")} == {(0,), (1,)}


def test_device_order_is_checked_for_a_declared_inventory():
    text = """
hosts:
  - name: h
    cuda_visible_devices: "1,0"%s
    gpus: [{id: 0, name: NVIDIA A100-SXM4-80GB}, {id: 1, name: NVIDIA H100 80GB HBM3}]
"""
    plan = make_plan(graph("  actor: {kind: R:Actor, devices: [0]}"), inventory(text % ""))
    assert codes(plan) == {("device-order", None)} and "PCI_BUS_ID" in plan.warnings[0].message
    fixed = make_plan(graph("  actor: {kind: R:Actor, devices: [0]}"), inventory(text % "\n    cuda_device_order: PCI_BUS_ID"))
    assert codes(fixed) == set()


def test_a_finding_repeated_per_replica_is_folded_into_one_naming_all_devices(a100):
    plan = plan_of("  rollout: {kind: R:Rollout, replicas: 2, devices: [1, 2, 5, 6]}", a100)
    (finding,) = plan.findings
    assert finding.code == "nvlink-missed" and finding.devices == (1, 2, 5, 6) and "2 times" in finding.message


def test_replicas_of_a_stateful_node_are_an_error_unless_the_class_says_how_they_merge(a100):
    plan = plan_of("  trainer: {kind: R:Trainer, replicas: 2}\n  gen: {kind: R:Subscriber}", a100,
                   "weights: [trainer -> gen]")
    assert codes(plan) == {("stateful-replicas", "trainer")} and "devices: 2" in plan.errors[0].message
    merging = plan_of("  trainer: {kind: R:MergingTrainer, replicas: 2}\n  gen: {kind: R:Subscriber}", a100,
                      "weights: [trainer -> gen]")
    assert codes(merging) == set()


def test_a_trainer_nobody_samples_from_is_a_warning_and_a_subscriber_without_weights_an_error(a100):
    alone = plan_of("  trainer: {kind: R:Trainer}", a100)
    assert codes(alone) == {("no-weight-subscriber", "trainer")} and not alone.errors
    # a subscriber no weights: edge feeds waits at its version gate for ever once the trainer publishes
    plan = plan_of("  trainer: {kind: R:Trainer}\n  gen: {kind: R:Subscriber}", a100)
    assert codes(plan) == {("unfed-subscriber", "gen")} and "weights: [trainer -> gen]" in plan.errors[0].message


def test_bf16_on_a100_next_to_fp16_on_v100_is_an_error_and_fp16_on_both_passes(tmp_path):
    inv = inventory("""
hosts:
  - {name: a100, nvswitch: true, gpu_defaults: {name: A100, memory_gb: 80, compute_capability: "8.0"},
     gpus: [{id: 0}, {id: 1}, {id: 2}, {id: 3}]}
  - {name: v100, nvswitch: true, gpu_defaults: {name: V100, memory_gb: 32, compute_capability: "7.0"},
     gpus: [{id: 0}, {id: 1}, {id: 2}, {id: 3}]}
""")
    text = """\
  prompts: {kind: prompts}
  rollout: {kind: rollout, host: v100, devices: 1, replicas: 3, dtype: float16}
  reward: {kind: reward, host: v100}
  reference: {kind: reference, host: a100, devices: [2, 3], dtype: %s}
  advantages: {kind: group_advantages}
  actor: {kind: actor, host: a100, devices: [0, 1], dtype: %s}
"""
    edges = ("edges: [prompts -> rollout, rollout -> reward, reward -> reference, reference -> advantages, "
             "advantages -> actor]\nweights: [actor -> rollout]\n")
    mixed = make_plan(graph(text % ("bfloat16", "bfloat16"), edges), inv)
    assert codes(mixed) == {("dtype-mismatch", "rollout")} and not mixed.ok  # the weights edge, bf16 -> fp16
    message = mixed.errors[0].message
    assert "actor -> rollout" in message and "65,504" in message and "`float16` on both" in message
    aligned = make_plan(graph(text % ("float16", "float16"), edges), inv)
    assert aligned.ok and not aligned.warnings, [f.message for f in aligned.findings]
