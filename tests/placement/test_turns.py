"""The memory model of colocated nodes: the larger turn for those that take turns, the sum for the
rest, every set of nodes sharing a GPU checked; model sizes never skipped silently; foreign memory
on a busy GPU counted; float16 next to bfloat16 an error."""

import pytest

from flowrl.placement.devices import Device
from flowrl.placement.memory import CONTEXT_BYTES, GIB
from flowrl.placement.rules_memory import size_from_name
from flowrl.placement.turns import DeviceLoad

from tests.placement.conftest import codes, plan_of

HYBRID = """\
  actor: {kind: R:Actor, devices: [0, 1], model_size: %s}
  rollout: {kind: R:Engine, devices: [0, 1], colocate_with: [actor], config: {gpu_memory_utilization: 0.4}%s}
"""


def test_nodes_that_take_turns_need_the_larger_turn_where_the_sum_would_not_fit(a100):
    summed = plan_of(HYBRID % ("7B", ""), a100)  # 7B actor: 16 B/param over 2 ranks, 53.2 GiB; engine 32 GiB
    assert codes(summed) == {("memory-exceeded", "actor")}
    assert "declare `take_turns: true` on `actor`" in summed.errors[0].message
    plan = plan_of(HYBRID % ("7B", ", take_turns: true"), a100)
    assert plan.ok and codes(plan) == set(), [f.message for f in plan.findings]
    (row,) = plan.memory
    assert row["devices"] == [0, 1] and row["turns"]
    assert row["text"].startswith("max(actor 53.2 GiB, rollout 32.0 GiB) turns + 1.0 GiB asleep")
    assert row["summed_bytes"] > 80 * GIB > row["bytes"]


def test_when_even_the_larger_turn_does_not_fit_the_error_names_gpus_nodes_and_fix(a100):
    plan = plan_of(HYBRID % ("14B", ", take_turns: true"), a100)
    (finding,) = plan.errors
    assert (finding.code, finding.node, finding.devices) == ("memory-exceeded", "actor", (0, 1))
    text = finding.message
    assert "GPU(s) 0, 1 hold max(actor" in text and "rollout 32.0 GiB) turns" in text
    assert "Fix: shard it over at least" in text and "move `rollout`" not in text  # a turn partner frees nothing


def test_a_turn_group_counts_its_larger_member_and_what_the_sleeping_keep_others_add_up():
    load = DeviceLoad(Device("h", 0, memory_bytes=80 * GIB), {"actor": 50 * GIB, "rollout": 30 * GIB, "reward": 5 * GIB},
                      {"actor": 1, "rollout": 1, "reward": 1}, [["actor", "rollout"]])
    assert load.total == 50 * GIB + CONTEXT_BYTES + 5 * GIB and load.summed == 85 * GIB
    assert load.text() == "max(actor 50.0 GiB, rollout 30.0 GiB) turns + 1.0 GiB asleep (CUDA context) + reward 5.0 GiB"


def test_every_set_of_nodes_sharing_a_gpu_is_checked_and_named(a100):
    plan = plan_of("""\
  actor: {kind: R:Actor, devices: [0, 1], model_size: 8B}
  reference: {kind: R:Reference, devices: [0], colocate_with: [actor], model_size: 8B}
  rollout: {kind: R:Engine, devices: [1], colocate_with: [actor], config: {gpu_memory_utilization: 0.3}}
""", a100)
    (finding,) = plan.errors
    assert finding.code == "memory-exceeded" and finding.devices == (0, 1)
    assert "GPU(s) 0 hold actor 60.6 GiB + reference 30.8 GiB" in finding.message
    assert "GPU(s) 1 hold actor 60.6 GiB + rollout 24.0 GiB" in finding.message


@pytest.mark.parametrize("name, params", [("SmolLM2-135M-Instruct", 135e6), ("Qwen2.5-0.5B", 0.5e9),
                                          ("Llama-3.1-8B", 8e9), ("models/llama-70b", 70e9),
                                          ("Qwen3-30B-A3B", 30e9), ("my-policy", None), ("Mixtral-8x7B", None)])
def test_a_size_is_read_from_a_well_known_folder_name(name, params):
    found = size_from_name(f"/cluster/{name}")
    assert (found[0] if found else None) == (int(params) if params else None)


def test_a_model_folder_not_here_without_a_size_is_a_warning_naming_the_fix(a100, tmp_path):
    plan = plan_of(f"  actor: {{kind: R:ModelActor, devices: [0, 1], config: {{model: {{type: hf, path: {tmp_path}/my-policy}}}}}}",
                   a100)
    assert codes(plan) == {("model-size-unknown", "actor")}
    (finding,) = plan.warnings
    assert finding.devices == (0, 1) and "`model_size: 7B` on `actor`" in finding.message
    assert "my-policy/config.json is not on this machine" in finding.message


def test_a_size_from_the_folder_name_is_used_and_said(tmp_path):
    plan = plan_of(f"  actor: {{kind: R:ModelActor, devices: [0, 1], dtype: bfloat16, "
                   f"config: {{model: {{type: hf, path: {tmp_path}/Qwen2.5-72B-Instruct}}}}}}", "mixed-40-80.yaml")
    assert codes(plan) == {("memory-exceeded", "actor")}
    assert "72.00B parameters from the folder name `Qwen2.5-72B-Instruct`" in plan.errors[0].message


def test_memory_another_job_holds_counts_and_a_trainer_left_under_10_percent_is_an_error():
    trainer = plan_of("  actor: {kind: R:Actor, devices: [3, 4], model_size: 3.5B}", "busy4.yaml")
    (finding,) = trainer.errors  # 27.1 GiB fits in the 32.2 GiB left, but leaves 5 GiB of an 80 GiB card
    assert finding.code == "device-busy" and "32.2 GiB left" in finding.message and "10%" in finding.message
    row = next(r for r in trainer.memory if r["devices"] == [3])
    assert "47.8 GiB of another job" in row["text"] and row["bytes"] > 74 * GIB
    forward = plan_of("  reference: {kind: R:Reference, devices: [3], model_size: 13B, dtype: bfloat16}", "busy4.yaml")
    assert codes(forward) == {("device-busy", "reference")} and forward.ok  # 25.2 GiB: tight, not over


def test_float16_next_to_bfloat16_on_any_edge_is_an_error(a100):
    plan = plan_of("  gen: {kind: R:Source, devices: [0], dtype: float16}\n"
                   "  train: {kind: R:Sink, devices: [1], dtype: bfloat16}", a100, "edges: [gen -> train]")
    assert codes(plan) == {("dtype-mismatch", "train")} and not plan.ok
    assert "`float16` on both" in plan.errors[0].message
