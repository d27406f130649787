"""Each finding family from the seeds, triggered by a minimal graph + inventory: code and node."""

from flowrl.placement import CODES, make_plan
from flowrl.placement.declared import DeclaredInventory

from tests.placement.conftest import codes, graph, inventory, plan_of

TWO_HOSTS = """
hosts:
  - {name: a, address: 10.0.0.1, nvswitch: true, gpu_defaults: {memory_gb: 80, compute_capability: "9.0"},
     gpus: [{id: 0}, {id: 1}, {id: 2}, {id: 3}]}
  - {name: b, address: 10.0.0.2, nvswitch: true, gpu_defaults: {memory_gb: 80, compute_capability: "9.0"},
     gpus: [{id: 0}, {id: 1}, {id: 2}, {id: 3}]}
"""


def test_device_beyond_the_visible_ones_is_reported_with_the_mapping():
    inv = DeclaredInventory.from_text("""
hosts:
  - {name: h, cuda_visible_devices: "3,1", gpus: [{id: 0}, {id: 1}, {id: 2}, {id: 3}]}
""")
    plan = make_plan(graph("  critic: {kind: R:Critic, devices: [2]}"), inv)
    assert codes(plan) == {("device-not-visible", "critic")}
    message = plan.errors[0].message
    assert "CUDA_VISIBLE_DEVICES=3,1" in message and "0=3, 1=1" in message and "0-1" in message


def test_unknown_host_is_reported():
    plan = plan_of("  actor: {kind: R:Actor, devices: 1, host: c}", TWO_HOSTS)
    assert codes(plan) == {("unknown-host", "actor")}


def test_actor_and_critic_on_the_same_gpu_is_an_error(a100):
    plan = plan_of("  actor: {kind: R:Actor, devices: [0, 1]}\n  critic: {kind: R:Critic, devices: [1, 2]}", a100)
    assert ("overlap-forbidden", "critic") in codes(plan) or ("overlap-forbidden", "actor") in codes(plan)
    assert plan.errors[0].devices == (1,)


def test_reference_on_the_actors_gpus_is_an_error_unless_colocation_is_declared(a100):
    nodes = "  actor: {kind: R:Actor, devices: [0, 1]}\n  reference: {kind: R:Reference, devices: [0]%s}"
    assert codes(plan_of(nodes % "", a100)) == {("overlap-forbidden", "reference")}
    assert codes(plan_of(nodes % ", colocate_with: [actor]", a100)) == set()


def test_reference_and_reward_may_share():
    plan = plan_of("  reference: {kind: R:Reference, devices: [0]}\n  reward: {kind: R:Reward, devices: [0]}",
                   "a100x8-nvlink.yaml")
    assert codes(plan) == set()


def test_other_undeclared_gpu_sharing_is_a_warning(a100):
    plan = plan_of("  actor: {kind: R:Actor, devices: [0]}\n  rollout: {kind: R:Rollout, devices: [0]}", a100)
    assert codes(plan) == {("overlap", "rollout")}
    assert plan.ok


def test_asking_for_more_gpus_than_exist_is_an_error(a100):
    plan = plan_of("  actor: {kind: R:Actor, devices: 4, replicas: 3}", a100)
    assert codes(plan) == {("not-enough-devices", "actor")}
    assert plan.for_node("actor") == []


def test_auto_without_free_gpus_left_is_an_error_naming_the_sharing(a100):
    plan = plan_of("  actor: {kind: R:Actor, devices: 8}\n  critic: {kind: R:Critic, devices: 2}", a100)
    assert codes(plan) == {("not-enough-devices", "critic")}
    assert "share" in plan.errors[0].message


def test_mixed_memory_in_one_group_is_a_warning():
    plan = plan_of("  actor: {kind: R:Actor, devices: [2, 3, 4, 5]}", "mixed-40-80.yaml")
    assert codes(plan) == {("mixed-memory", "actor")}
    assert "40 GiB" in plan.warnings[0].message


def test_busy_gpu_is_a_warning_with_pid_and_memory_when_the_plan_still_fits():
    plan = plan_of("  actor: {kind: R:Actor, devices: [3, 4], model_size: 1B}", "busy4.yaml")
    assert codes(plan) == {("device-busy", "actor")}
    finding = plan.warnings[0]
    assert finding.devices == (3,) and "pid 41010" in finding.message and "47.8 GiB" in finding.message


def test_busy_gpu_is_an_error_when_what_is_left_is_less_than_the_plan_needs():
    plan = plan_of("  actor: {kind: R:Actor, devices: [3, 4], model_size: 7B}", "busy4.yaml")
    (finding,) = plan.errors
    assert finding.code == "device-busy" and "32.2 GiB left" in finding.message
    unknown = plan_of("  actor: {kind: R:Actor, devices: [3, 4]}", "busy4.yaml")  # no model: half the card
    assert [f.code for f in unknown.errors] == ["device-busy"]


def test_a_tiny_foreign_process_like_an_mps_daemon_does_not_make_a_gpu_busy():
    inv = inventory("""
hosts:
  - name: h
    gpu_defaults: {memory_gb: 80, compute_capability: "9.0"}
    gpus:
      - {id: 0, processes: [{pid: 7, memory_gb: 0.03, name: nvidia-cuda-mps-server}]}
      - {id: 1, processes: [{pid: 8, memory_gb: 0.03, name: nvidia-cuda-mps-server}]}
""")
    plan = make_plan(graph("  actor: {kind: R:Actor, devices: [0, 1]}"), inv)
    assert codes(plan) == set() and not inv.hosts[0].devices[0].busy


def test_group_without_nvlink_when_a_linked_pair_exists_is_a_warning(a100):
    plan = plan_of("  critic: {kind: R:Critic, devices: [1, 2]}", a100)
    assert codes(plan) == {("nvlink-missed", "critic")}
    assert "use devices [0, 1]" in plan.warnings[0].message


def test_group_split_over_pcie_roots_is_a_warning(a100):
    plan = plan_of("  actor: {kind: R:Actor, devices: [0, 1, 4, 5]}", a100)
    assert codes(plan) == {("pcie-split", "actor")}


def test_mesh_that_does_not_match_the_device_count_is_an_error(a100):
    plan = plan_of("  actor: {kind: R:Actor, devices: [0, 1, 2, 3], mesh: [2, 4]}", a100)
    assert codes(plan) == {("mesh-mismatch", "actor")}
    assert "[2, 2]" in plan.errors[0].message


def test_device_list_that_does_not_split_over_replicas_is_an_error(a100):
    plan = plan_of("  rollout: {kind: R:Rollout, replicas: 2, devices: [0, 1, 2]}", a100)
    assert codes(plan) == {("replica-split", "rollout")}


def test_compute_dtype_tensors_into_a_node_of_another_dtype_is_a_warning(a100):
    plan = plan_of("  gen: {kind: R:HiddenSource, devices: [0], dtype: bfloat16}\n  train: {kind: R:Sink, devices: [1]}",
                   a100, "edges: [gen -> train]")
    assert codes(plan) == {("dtype-mismatch", "train")}
    assert plan.ok and "would fail" not in plan.warnings[0].message and "unless" in plan.warnings[0].message


def test_different_dtypes_on_an_edge_of_ids_and_float32_scores_are_fine(a100):
    plan = plan_of("  gen: {kind: R:Source, devices: [0], dtype: bfloat16}\n  train: {kind: R:Sink, devices: [1]}",
                   a100, "edges: [gen -> train]")
    assert codes(plan) == set()


def test_bfloat16_below_compute_capability_8_is_an_error():
    plan = plan_of("  actor: {kind: R:Actor, devices: [0, 1], dtype: bfloat16}", "v100x8-dgx1.yaml")
    assert codes(plan) == {("bf16-unsupported", "actor")}


def test_interleaved_hosts_in_one_group_is_a_rank_layout_error():
    plan = plan_of('  actor: {kind: R:Actor, devices: ["a:0", "b:0", "a:1", "b:1"]}', TWO_HOSTS)
    assert codes(plan) == {("rank-layout", "actor")}


def test_uneven_processes_per_host_is_a_rank_layout_error():
    plan = plan_of('  actor: {kind: R:Actor, devices: ["a:0", "a:1", "a:2", "b:0"]}', TWO_HOSTS)
    assert codes(plan) == {("rank-layout", "actor")}


def test_tensor_parallel_dimension_across_hosts_is_a_warning_whose_fix_keeps_it_in_a_host():
    plan = plan_of('  actor: {kind: R:Actor, devices: ["a:0", "a:1", "b:0", "b:1"], mesh: [1, 4]}', TWO_HOSTS)
    assert codes(plan) == {("tp-across-hosts", "actor")}
    assert "use mesh [2, 2]" in plan.warnings[0].message


def test_flat_fsdp_group_spread_over_hosts_is_fine():
    for mesh in ("", ", mesh: [4]", ", mesh: [4, 1]"):
        plan = plan_of('  actor: {kind: R:Actor, devices: ["a:0", "a:1", "b:0", "b:1"]%s}' % mesh, TWO_HOSTS)
        assert codes(plan) == set(), mesh


def test_invalid_cuda_visible_devices_entry_is_a_warning():
    inv = inventory('hosts: [{name: h, cuda_visible_devices: "0,7,1", gpus: [{id: 0}, {id: 1}]}]')
    plan = make_plan(graph("  actor: {kind: R:Actor, devices: [0]}"), inv)
    assert codes(plan) == {("cuda-visible-invalid", None)}
    assert inv.hosts[0].visible == [0]


def test_every_code_has_a_severity_family_and_description():
    for code, (severity, family, text) in CODES.items():
        assert severity in ("error", "warning", "info") and family and text, code
