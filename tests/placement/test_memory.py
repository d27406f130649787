"""The memory model: pure functions on known models, and the findings on the articles' layouts."""

import json

import pytest

from flowrl.placement.memory import GIB, ModelShape, hf_shape, min_ranks, node_need, tiny_params

from tests.placement.conftest import codes, inventory, plan_of

QWEN_72B = {"model_type": "qwen2", "hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 29568,
            "vocab_size": 152064, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_act": "silu",
            "tie_word_embeddings": False}
LLAMA_7B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008,
            "vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu"}
QWEN_05B = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864,
            "vocab_size": 151936, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_act": "silu",
            "tie_word_embeddings": True}


@pytest.mark.parametrize("config, billions", [(QWEN_72B, 72.7), (LLAMA_7B, 6.74), (QWEN_05B, 0.494)])
def test_parameters_from_a_hugging_face_config_match_the_published_counts(config, billions):
    assert hf_shape(config).params / 1e9 == pytest.approx(billions, rel=0.005)


def test_parameters_of_the_built_in_model_match_the_real_module():
    torch = pytest.importorskip("torch")  # noqa: F841
    from flowrl.models import build_model
    from flowrl.models.spec import TinyLMSpec

    for kw in ({}, {"d_model": 64, "n_layers": 1, "n_heads": 4}, {"tie_embeddings": True, "positions": "rope"}):
        s = TinyLMSpec(**kw)
        real = sum(p.numel() for p in build_model(s, value_head=False, seed=0).parameters())
        assert tiny_params(s.d_model, s.n_layers, s.vocab_size, s.mlp_ratio, s.max_seq_len, s.tie_embeddings,
                           s.positions) == real


def test_a_trainer_holds_16_bytes_per_parameter_sharded_over_its_ranks():
    shape = ModelShape(params=1_000_000_000)
    for dtype in ("bfloat16", "float32"):
        need = node_need(shape, role="actor", dtype=dtype, ranks=4, card_bytes=80 * GIB)
        assert need.total - need.parts["CUDA context"] == 16 * 10**9 // 4
    forward = node_need(shape, role="reference", dtype="bfloat16", ranks=2, card_bytes=80 * GIB)
    assert forward.parts["weights"] == 10**9 and "gradients" not in forward.parts


def test_activations_count_hidden_states_for_trainers_and_fp32_logits_for_everyone():
    shape = ModelShape(params=10, hidden=1000, layers=10, vocab=100)
    train = node_need(shape, role="critic", dtype="bfloat16", ranks=1, card_bytes=None, tokens=10)
    ref = node_need(shape, role="reference", dtype="bfloat16", ranks=1, card_bytes=None, tokens=10)
    assert train.parts["activations"] == 10 * 1000 * 10 * 2 + 10 * 100 * 4
    assert ref.parts["activations"] == 10 * 100 * 4


def test_an_engine_reservation_is_its_share_of_the_card():
    need = node_need(ModelShape(10**12), role="rollout", dtype="bfloat16", ranks=1, card_bytes=80 * GIB,
                     reserve_share=0.5)
    assert need.total == 40 * GIB


def test_fewest_ranks_that_fit_a_72b_trainer_on_40_gb_cards():
    n = min_ranks(hf_shape(QWEN_72B), role="actor", dtype="bfloat16", card_bytes=40 * GIB)
    assert 36 <= n <= 42  # 1,083 GiB of state over what is left of 36 GiB after activations and context


def _hf(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


GRPO = """\
  prompts: {kind: prompts}
  rollout: {kind: rollout, devices: %(rollout)s, dtype: bfloat16, config: {model: %(model)s}}
  reward: {kind: reward}
  reference: {kind: reference, devices: %(reference)s, colocate_with: [actor], config: {model: %(model)s}}
  advantages: {kind: group_advantages}
  actor: {kind: actor, devices: %(actor)s, dtype: bfloat16, config: {model: %(model)s}}
"""
EDGES = """\
edges: [prompts -> rollout, rollout -> reward, reward -> reference, reference -> advantages, advantages -> actor]
weights: [actor -> rollout]
"""


def test_a_72b_policy_on_two_40_gb_gpus_is_an_error_with_the_numbers(tmp_path):
    model = "{type: hf, path: %s, dtype: bfloat16}" % _hf(tmp_path, QWEN_72B)
    plan = plan_of(GRPO % dict(rollout="[4, 5, 6, 7]", reference="[0, 1]", actor="[0, 1]", model=model),
                   "mixed-40-80.yaml", EDGES)
    (finding,) = [f for f in plan.errors if f.code == "memory-exceeded"]
    m = finding.message
    assert finding.node == "actor" and finding.devices == (0, 1)
    assert "72.71B parameters" in m and "40.0 GiB each" in m and "sharded over 2 ranks" in m
    assert "Adam state" in m and "at least 4" in m and "offload" in m and "micro-batch" in m
    assert "`reference`" in m  # the colocated reference adds to the same GPUs


def test_a_7b_actor_with_its_reference_on_8_by_80_gb_is_fine(tmp_path):
    model = "{type: hf, path: %s, dtype: bfloat16}" % _hf(tmp_path, LLAMA_7B)
    plan = plan_of(GRPO % dict(rollout="[4, 5, 6, 7]", reference="[0, 1, 2, 3]", actor="[0, 1, 2, 3]", model=model),
                   "a100x8-nvlink.yaml", EDGES)
    assert not [f for f in plan.findings if f.code.startswith("memory")], [f.message for f in plan.findings]


def test_colocated_nodes_add_up_on_a_gpu_and_near_full_is_a_headroom_warning():
    nodes = ("  actor: {kind: R:Actor, devices: [0, 1], model_size: 7B}\n"
             "  engine: {kind: R:Engine, devices: [0, 1], colocate_with: [actor], config: {gpu_memory_utilization: %s}}")
    assert codes(plan_of(nodes % 0.1, "a100x8-nvlink.yaml")) == set()
    headroom = plan_of(nodes % 0.3, "a100x8-nvlink.yaml")
    assert codes(headroom) == {("memory-headroom", "actor")}
    assert "engine" in headroom.warnings[0].message
    over = plan_of(nodes % 0.5, "a100x8-nvlink.yaml")
    assert codes(over) == {("memory-exceeded", "actor")}
    assert "gpu_memory_utilization" not in over.errors[0].message or "move" in over.errors[0].message


def test_model_size_declares_a_model_this_machine_does_not_have():
    plan = plan_of("  actor: {kind: R:Actor, devices: [0], model_size: 72B}", "a100x8-nvlink.yaml")
    assert codes(plan) == {("memory-exceeded", "actor")}
    assert "model_size" in plan.errors[0].message


def test_forward_only_node_in_float32_is_told_about_bfloat16():
    plan = plan_of("  reference: {kind: R:Reference, devices: [0], model_size: 30B}", "a100x8-nvlink.yaml")
    assert codes(plan) == {("memory-exceeded", "reference")}
    assert "bfloat16" in plan.errors[0].message


def test_cpu_plans_have_no_memory_findings():
    plan = plan_of("  actor: {kind: R:Actor, devices: 1, model_size: 72B}", "laptop-2cpu.yaml")
    assert not [f for f in plan.findings if f.code.startswith("memory")]


def test_a_bad_model_size_is_a_load_error_with_its_line():
    from flowrl.graph import GraphError

    with pytest.raises(GraphError) as e:
        plan_of("  actor: {kind: R:Actor, model_size: lots}", inventory("a100x8-nvlink.yaml"))
    assert e.value.problems[0].path == "nodes.actor.model_size" and e.value.problems[0].line == 2


def test_lora_adapters_are_counted_r_times_in_plus_out_per_targeted_layer():
    from flowrl.placement.memory import lora_params

    shape = hf_shape(LLAMA_7B)
    # q_proj and v_proj of Llama-7B: 4096 -> 4096 each, 32 blocks, r = 16: 16 x 8192 x 2 x 32
    assert lora_params(shape, {"r": 16, "target_modules": ["q_proj", "v_proj"]}) == 16 * 8192 * 2 * 32
    everything = lora_params(shape, {"r": 8})
    assert everything == 8 * 32 * (4 * 8192 + 3 * (4096 + 11008))  # all seven linear layers
    assert lora_params(ModelShape(10**9), {"r": 8}) is None  # no layers known: trained in full


def test_a_lora_trainer_holds_frozen_weights_and_only_the_adapters_training_state(tmp_path):
    model = "{type: hf, path: %s, dtype: bfloat16}" % _hf(tmp_path, LLAMA_7B)
    node = "  actor: {kind: R:ModelActor, devices: [0], dtype: bfloat16, config: {model: %s%s}}"
    full = plan_of(node % (model, ""), "mixed-40-80.yaml")  # 6.74B x 16 bytes = 100 GiB on a 40 GB card
    assert codes(full) == {("memory-exceeded", "actor")}
    lora = plan_of(node % (model, ", train: {lora: {r: 16, target_modules: [q_proj, v_proj]}}"), "mixed-40-80.yaml")
    assert codes(lora) == set(), [f.message for f in lora.findings]
    (row,) = lora.memory
    assert 12 * GIB < row["bytes"] < 20 * GIB  # 12.6 GiB of bf16 weights, adapters, activations, context
