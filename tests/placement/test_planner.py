"""The planner: auto groups by topology, explicit lists, ranks as torchrun lays them out, env."""

import pytest

from flowrl.graph import load_graph
from flowrl.placement import Plan, get_inventory, make_plan
from flowrl.placement.declared import DeclaredInventory

from tests.placement.conftest import ROOT, codes, graph, inventory, plan_of


def devices_of(plan, node):
    return [e.devices[0] for e in plan.for_node(node)]


def test_auto_on_the_nvlink_node_picks_nvlink_connected_groups(a100):
    plan = plan_of("""
  actor: {kind: R:Actor, devices: 4, mesh: [2, 2]}
  critic: {kind: R:Critic, devices: 2}
  rollout: {kind: R:Rollout, devices: 2}
""", a100)
    assert codes(plan) == set()
    assert devices_of(plan, "actor") == [0, 1, 2, 3]  # two bridged pairs on one socket
    groups = [devices_of(plan, "critic")] + [[e.devices[0] for e in g] for (n, _), g in plan.groups().items() if n == "rollout"]
    for group in groups:
        a, b = group
        assert b in a100.device("gpu-node", a).nvlink_peers, group


def test_auto_keeps_nvlink_pairs_whole_around_explicit_devices(a100):
    plan = plan_of("  reward: {kind: R:Reward, devices: [1]}\n  critic: {kind: R:Critic, devices: 2}", a100)
    assert devices_of(plan, "critic") == [2, 3]


def test_auto_avoids_busy_gpus():
    plan = plan_of("  actor: {kind: R:Actor, devices: 2}\n  rollout: {kind: R:Rollout, replicas: 2}", "busy4.yaml")
    used = {d for e in plan.entries for d in e.devices}
    assert used and used.isdisjoint({0, 1, 2, 3}) and plan.ok


def test_auto_avoids_busy_gpus_on_the_nvlink_node():
    text = (ROOT / "examples/inventories/a100x8-nvlink.yaml").read_text()
    text = text.replace("{id: 0, nvlink", "{id: 0, processes: [{pid: 7, memory_gb: 20}], nvlink")
    plan = plan_of("  actor: {kind: R:Actor, devices: 2}", DeclaredInventory.from_text(text))
    assert devices_of(plan, "actor") == [2, 3]


def test_auto_gives_the_biggest_cards_to_the_actor_and_never_mixes_sizes():
    plan = plan_of("  actor: {kind: R:Actor, devices: 4}\n  critic: {kind: R:Critic, devices: 4}", "mixed-40-80.yaml")
    assert devices_of(plan, "actor") == [4, 5, 6, 7] and devices_of(plan, "critic") == [0, 1, 2, 3]
    assert codes(plan) == set()


def test_colocated_node_lands_on_its_partners_devices(a100):
    plan = plan_of("  actor: {kind: R:Actor, devices: 4}\n  reference: {kind: R:Reference, colocate_with: [actor]}", a100)
    assert devices_of(plan, "reference")[0] in devices_of(plan, "actor")
    assert codes(plan) == set()


def test_roleless_auto_node_runs_on_the_host_cpu_of_a_gpu_machine(a100):
    plan = plan_of("  helper: {kind: R:Helper}", a100)
    (entry,) = plan.entries
    assert entry.device_type == "cpu" and entry.devices == []
    env = plan.env_for(entry, master_port=1)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and "FLOWRL_CPU_CORES" not in env


def test_group_spanning_two_hosts_gets_torchrun_ranks_and_one_master():
    plan = plan_of("  actor: {kind: R:Actor, devices: 16, mesh: [2, 8]}", "cluster-2x8.yaml")
    entries = plan.for_node("actor")
    assert [e.rank for e in entries] == list(range(16))
    assert [e.local_rank for e in entries] == list(range(8)) * 2
    assert [e.host for e in entries] == ["node0"] * 8 + ["node1"] * 8
    assert {e.master_addr for e in entries} == {"192.168.1.10"} and {e.world_size for e in entries} == {16}
    env = plan.env_for(entries[9], master_port=29500)
    assert env["RANK"] == "9" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "16"
    assert env["LOCAL_WORLD_SIZE"] == "8" and env["MASTER_ADDR"] == "192.168.1.10"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert entries[9].mesh_coord == [1, 1]


def test_each_replica_is_its_own_group_and_sees_only_its_devices(a100):
    plan = plan_of("  rollout: {kind: R:Rollout, replicas: 2, devices: [4, 5, 6, 7]}", a100)
    groups = plan.groups()
    assert set(groups) == {("rollout", 0), ("rollout", 1)}
    second = groups["rollout", 1]
    assert [(e.rank, e.world_size, e.devices, e.local_devices) for e in second] == [(0, 2, [6], [0]), (1, 2, [7], [1])]
    assert plan.env_for(second[1], master_port=2)["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_env_for_requires_a_port_when_the_plan_defers_it(a100):
    plan = plan_of("  actor: {kind: R:Actor, devices: [0]}", a100)
    assert plan.entries[0].master_port is None
    with pytest.raises(ValueError, match="master_port"):
        plan.env_for(plan.entries[0])


def test_cpu_auto_balances_cores_by_what_each_role_costs_and_only_notes_the_sharing():
    plan = make_plan(load_graph(ROOT / "graphs/ppo.yaml"), inventory("laptop-2cpu.yaml"))
    assert plan.ok and not plan.warnings and len(plan.entries) == 6
    core = {e.node: e.devices[0] for e in plan.entries}
    assert sorted(core.values()) in ([0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1])
    assert core["actor"] != core["critic"]  # the two trainers, the heaviest, never share a core here
    assert core["rollout"] != core["reference"]
    assert {f.code for f in plan.findings} == {"cpu-shared"}
    env = plan.env_for(plan.entries[0], master_port=3)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["FLOWRL_CPU_CORES"] == str(plan.entries[0].devices[0])


def test_cpu_auto_keeps_the_actor_core_for_the_actor_in_grpo():
    """GRPO on two cores: the actor's step is most of the work; the rollout and the reference (one
    forward pass each) share the other core, so that with max_staleness 1 both cores stay busy."""
    shipped = make_plan(load_graph(ROOT / "graphs/grpo.yaml"), inventory("laptop-2cpu.yaml"))
    assert {e.node: e.devices[0] for e in shipped.entries} in ({"rollout": 1, "actor": 0}, {"rollout": 0, "actor": 1})
    own = [f"nodes.{n}.fuse_into=null" for n in ("prompts", "reward", "reference", "advantages")]  # six processes
    plan = make_plan(load_graph(ROOT / "graphs/grpo.yaml", own), inventory("laptop-2cpu.yaml"))
    core = {e.node: e.devices[0] for e in plan.entries}
    assert core["rollout"] == core["reference"] != core["actor"]
    assert [n for n, c in core.items() if c == core["actor"]] in (["actor"], ["advantages", "actor"],
                                                                    ["prompts", "actor"], ["reward", "actor"])


def test_shipped_ppo_plans_cleanly_on_this_machine():
    plan = make_plan(load_graph(ROOT / "graphs/ppo.yaml"), get_inventory())
    assert plan.ok


def test_cpu_node_asking_for_two_cores_gets_two_ranks_on_distinct_cores():
    plan = plan_of("  actor: {kind: R:Actor, devices: 2, mesh: [2]}", "laptop-2cpu.yaml")
    assert [(e.rank, e.devices, e.local_devices, e.device_type) for e in plan.entries] == [
        (0, [0], [0], "cpu"), (1, [1], [1], "cpu")]


def test_core_outside_the_affinity_set_is_not_visible():
    plan = plan_of("  actor: {kind: R:Actor, devices: [5]}", "laptop-2cpu.yaml")
    assert codes(plan) == {("device-not-visible", "actor")}


def test_plan_json_has_the_contract_shape_and_reads_back(a100):
    plan = plan_of("  actor: {kind: R:Actor, devices: [0, 1], mesh: [2]}\n  critic: {kind: R:Critic, devices: [1]}", a100)
    data = plan.to_json()
    assert set(data) == {"plan", "findings", "memory"}
    for key in ("node", "replica", "rank", "host", "devices", "local_devices"):
        assert key in data["plan"][0]
    assert set(data["findings"][0]) >= {"severity", "code", "node", "devices", "message"}
    again = Plan.from_json(data)
    assert again.entries == plan.entries and [f.code for f in again.findings] == [f.code for f in plan.findings]


def test_graph_built_in_python_plans_too(a100):
    from flowrl.graph import GraphSpec, NodeSpec

    spec = GraphSpec(nodes={"actor": NodeSpec(kind="tests.placement.roles:Actor", devices=2)})
    assert devices_of(make_plan(spec, a100), "actor") == [0, 1]


def test_explicit_lists_and_graph_overrides_combine(a100):
    g = graph("  actor: {kind: R:Actor, devices: [0, 1]}")
    assert devices_of(make_plan(g, a100), "actor") == [0, 1]


def test_cpu_weight_comes_from_the_role_or_else_from_what_the_node_does():
    """A user's node without a built-in role is weighed by its shape: one that publishes weights
    trains (a trainer's weight), one that subscribes generates; else it counts as one process."""
    import flowrl
    from flowrl.placement.planner import CPU_WEIGHT, cpu_weight

    class MyTrainer(flowrl.Node):
        publishes_weights = True

    class MySampler(flowrl.Node):
        subscribes_weights = True

    class MyScorer(flowrl.Node):
        pass

    assert cpu_weight(MyTrainer) == CPU_WEIGHT["actor"] > cpu_weight(MySampler) == CPU_WEIGHT["rollout"]
    assert cpu_weight(MyScorer) == 1.0
    assert cpu_weight(None) == 1.0
