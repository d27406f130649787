"""A LoRA actor in a real graph (`flowrl run` in a child process, every role its own process) on a tiny
Hugging Face Llama: GRPO with no reference node (the actor takes the KL's reference from its base with
the adapters off), checkpoints holding the adapters only, and `flowrl export` of the run.

The first test has no weight edge: its rollout takes no weights (tests/integration/lora_nodes.py) and
keeps sampling the base while the actor trains, which shows the trainer side alone. The second syncs the adapters into the rollout
(`weights: actor -> rollout`), which needs a rollout that applies adapter versions.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.testing import node_checkpoint, run_graph

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

pytest.importorskip("peft")


def graph(tmp_path: Path, model_dir: Path, *, sync: bool) -> Path:
    weights = "weights:\n  - actor -> rollout\n" if sync else ""
    rollout = "rollout" if sync else '"tests.integration.lora_nodes:BaseRollout"'
    text = f"""name: grpo-lora
seed: 0
vars:
  model: &model {{type: hf, path: "{model_dir.as_posix()}"}}
  task: &task {{name: reverse, digits: 3}}
nodes:
  prompts: {{kind: prompts, config: {{task: *task}}}}
  rollout: {{kind: {rollout}, config: {{model: *model, samples_per_prompt: 4}}}}
  reward: {{kind: reward, config: {{task: *task}}}}
  advantages: {{kind: group_advantages}}
  actor:
    kind: actor
    config:
      model: *model
      train:
        lr: 1.0e-2
        kl_loss_coef: 0.05
        lora: {{r: 4, alpha: 8, target_modules: [q_proj, k_proj, v_proj, o_proj], reference_from_base: true}}
edges:
  - prompts -> rollout
  - rollout -> reward
  - reward -> advantages
  - advantages -> actor
{weights}schedule: {{steps: {STEPS}, batch_size: 4, max_staleness: 0, checkpoint_every: {STEPS}}}
"""
    path = tmp_path / "grpo-lora.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def model_dir(tmp_path) -> Path:
    pytest.importorskip("transformers")
    from examples.hf_tiny.make_model import write_model

    return write_model(tmp_path / "hf-tiny", "tiny", seed=0, max_len=64)


def check_run(result, model_dir: Path, tmp_path: Path) -> None:
    import torch

    assert result.exit_code == 0, result.stderr[-3000:]
    restarts = [r for r in result.ledger if r["event"] in ("node_down", "reissued", "recovery")]
    assert restarts == [], restarts[:5]  # a fault-free run: nothing restarted, nothing re-issued
    audit = result.audit()
    assert audit.exactly_once and len(audit.issued) == STEPS
    rows = sorted(result.metrics, key=lambda r: r["step"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["kl_mean"] >= 0 for r in rows) and rows[-1]["kl_mean"] > 0  # the base's reference, in the loss
    state = node_checkpoint(result.run_dir, "actor")["node"]
    assert state["model"] and all(".lora_" in k for k in state["model"])  # adapters only
    assert state["base"]["path"] == str(model_dir)
    from flowrl.cli import main

    assert main(["export", str(result.run_dir), "--adapter", str(tmp_path / "adapter")]) == 0
    assert main(["export", str(result.run_dir), "--hf", str(tmp_path / "merged")]) == 0
    import transformers

    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q])  # the adapters trained and were merged
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.timeout(240)
def test_a_lora_actor_trains_without_a_reference_node_and_exports(tmp_path, model_dir):
    result = run_graph(graph(tmp_path, model_dir, sync=False), tmp_path / "run", timeout_s=220, cwd=ROOT)
    check_run(result, model_dir, tmp_path)


@pytest.mark.timeout(240)
def test_a_lora_actor_syncs_its_adapters_into_the_rollout(tmp_path, model_dir):
    result = run_graph(graph(tmp_path, model_dir, sync=True), tmp_path / "run", timeout_s=220, cwd=ROOT)
    check_run(result, model_dir, tmp_path)
    from tests.integration.test_rl_runs import consumed

    pairs = consumed(result.ledger)
    assert len(pairs) == STEPS and all(row["policy_version"] == i for i, row in pairs)  # on-policy: version n


@pytest.mark.timeout(240)
def test_a_lora_actor_and_its_rollout_take_turns_on_one_core_and_hand_adapters_over(tmp_path, model_dir):
    """LoRA and colocation together: actor and rollout share a core and take turns; each adapter
    version goes to the rollout by the shared-memory handoff (no broadcast), applied by its engine."""
    import json

    overrides = ["nodes.rollout.colocate_with=[actor]", "nodes.rollout.take_turns=true"]
    result = run_graph(graph(tmp_path, model_dir, sync=True), tmp_path / "run", overrides=overrides, timeout_s=220,
                       cwd=ROOT)
    check_run(result, model_dir, tmp_path)
    plan = json.loads((result.run_dir / "plan.json").read_text())
    cores = {p["node"]: tuple(p["devices"]) for p in plan["placements"]} if "placements" in plan else None
    if cores is not None:
        assert cores["actor"] == cores["rollout"], cores
    trace = json.loads((result.run_dir / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    syncs = [e for e in events if e.get("name") == "weight_sync" and e.get("ph") == "X"]
    assert syncs and all(e["args"].get("handoff") for e in syncs), syncs[:3]
