"""LoRA in the actor: only adapters train, publish and checkpoint; the base stays bitwise the same.

A tiny saved Llama (tests/models/conftest.py) is the base; the trainer is the real ActorTrainer and
the nodes are the built-in actor and reference, called in this process.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch

import flowrl
from flowrl.models import build_model
from flowrl.models.packing import packed_logprobs
from flowrl.rl import ActorConfig, ActorTrainer, LoraConfig
from tests.node_harness import call, make_node
from tests.rl.batches import random_batch

pytest.importorskip("peft")

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def trainer(path: str, seed: int = 0, **lora) -> ActorTrainer:
    cfg = ActorConfig(lr=1e-2, mini_batches=2, kl_loss_coef=0.1, max_tokens_per_microbatch=32,
                      lora=LoraConfig(**{**LORA, **lora}))
    return ActorTrainer(build_model({"type": "hf", "path": path}), cfg, seed=seed)


def step(t: ActorTrainer, seed: int) -> dict:
    b = random_batch(build_model({"type": "hf", "path": t.base["path"]}), 8, seed=seed)
    return t.train_step(tokens=b["tokens"], loss_mask=b["loss_mask"], old_logprobs=b["old_logprobs"],
                        advantages=b["advantages"], ref_logprobs=b["ref_logprobs"])


def roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def test_only_the_adapters_train_and_the_base_stays_bitwise_the_same(hf_model_dir):
    plain = build_model({"type": "hf", "path": hf_model_dir})
    t = trainer(hf_model_dir)
    adapter_ids = {id(p) for n, p in t.model.named_parameters() if ".lora_" in n}
    assert {id(p) for p in t.params} == adapter_ids and len(adapter_ids) == 2 * 4 * 2  # A, B x 4 targets x 2 layers
    assert {id(p) for g in t.optimizer.param_groups for p in g["params"]} == adapter_ids
    tokens = torch.randint(0, 18, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(t.model(tokens), plain(tokens))  # B = 0: the adapters start as no-ops
    for s in range(2):
        step(t, s)
    from flowrl.models.lora import base_state

    assert base_state(t.model).keys() == plain.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(base_state(t.model)[k], v), k
    with torch.no_grad():
        assert not torch.allclose(t.model(tokens), plain(tokens), atol=1e-4)


def test_published_adapters_rebuild_the_trained_model_from_the_plain_base(hf_model_dir):
    from flowrl.models.lora import adapter_weights, merged_state
    from flowrl.weights.adapters import adapter_targets, is_adapter_version, merged

    t = trainer(hf_model_dir, alpha=12)
    for s in range(2):
        step(t, s)
    plain = build_model({"type": "hf", "path": hf_model_dir}).eval()
    published = adapter_weights(t.model)
    assert is_adapter_version(published)
    targets = adapter_targets(published)
    assert set(targets) <= plain.state_dict().keys() and len(targets) == 8  # the plain model's own names
    q = "backbone.model.layers.0.self_attn.q_proj"
    layer = t.model.backbone.model.layers[0].self_attn.q_proj
    assert torch.equal(published[q + ".lora_A"], layer.lora_A["default"].weight)
    assert torch.allclose(published[q + ".lora_B"], layer.lora_B["default"].weight * 3.0)  # alpha / r = 12 / 4
    full = merged(plain.state_dict(), published)
    assert full.keys() == merged_state(t.model).keys()
    plain.load_state_dict(full)
    tokens = torch.randint(0, 18, (3, 11), generator=torch.Generator().manual_seed(1))
    t.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), t.model(tokens), atol=2e-5, rtol=1e-5)


def test_a_checkpoint_holds_the_adapters_and_resumes_to_the_same_next_update(hf_model_dir):
    t = trainer(hf_model_dir)
    step(t, 0)
    state = roundtrip(t.state_dict())
    assert state["model"] and all(".lora_" in k for k in state["model"])
    assert len(state["optimizer"]["state"]) == len(state["model"])  # moments of the adapters only
    assert state["base"]["path"] == hf_model_dir and len(state["base"]["fingerprint"]) == 32
    assert state["lora"]["r"] == 4
    again = trainer(hf_model_dir, seed=5)  # other adapter init: the checkpoint must overwrite it
    again.load_state_dict(state)
    m1, m2 = step(t, 1), step(again, 1)
    assert m1 == m2
    for (k, a), b in zip(t.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_restoring_onto_another_base_or_without_lora_is_a_clear_error(hf_model_dir, tmp_path):
    t = trainer(hf_model_dir)
    state = roundtrip(t.state_dict())
    other = build_model({"type": "hf", "path": hf_model_dir})
    with torch.no_grad():
        other.backbone.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    other.backbone.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=r"trained on the base .*fingerprint.*load the base they were trained on"):
        trainer(str(tmp_path / "other")).load_state_dict(state)
    full = ActorTrainer(build_model({"type": "hf", "path": hf_model_dir}), ActorConfig())
    with pytest.raises(ValueError, match="adapters only .* does not use train.lora"):
        full.load_state_dict(state)
    with pytest.raises(ValueError, match="a full model but this actor uses train.lora"):
        t.load_state_dict(roundtrip(full.state_dict()))


def test_config_errors_name_the_fix(hf_model_dir, monkeypatch):
    from flowrl.nodes.actor import Actor

    with pytest.raises(ValueError, match=r"model.type is 'tiny'.*type: hf"):
        Actor.Config.model_validate({"model": {"type": "tiny"}, "train": {"lora": {}}})
    with pytest.raises(ValueError, match="set kl_loss_coef > 0"):
        ActorConfig(lora={"reference_from_base": True})
    with pytest.raises(ValueError, match=r"\['qkv'\] name no linear layer.*q_proj"):
        trainer(hf_model_dir, target_modules=["q_proj", "qkv"])
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"pip install 'flowrl\[lora\]'"):
        trainer(hf_model_dir)


def node_batch(seed: int = 0) -> flowrl.Batch:
    from flowrl.tasks import VOCAB_SIZE

    g = torch.Generator().manual_seed(seed)
    tokens = flowrl.Ragged.from_sequences([torch.randint(0, VOCAB_SIZE, (int(n),), generator=g) for n in (9, 6, 12, 7)])
    pos = torch.arange(tokens.total) - tokens.offsets[:-1].repeat_interleave(tokens.lengths)
    mask = pos >= 4
    return flowrl.Batch(tensors={"tokens": tokens, "loss_mask": tokens.like(mask),
                                 "prompt_lens": torch.full((4,), 4, dtype=torch.int64),
                                 "logprobs": tokens.like(-torch.rand(tokens.total, generator=g) * mask),
                                 "advantages": tokens.like(torch.randn(tokens.total, generator=g) * mask),
                                 "scores": torch.rand(4, generator=g)},
                        meta={"samples_per_prompt": 2, "temperature": 0.7})


def test_the_actor_node_computes_the_reference_of_a_reference_node_and_publishes_adapters(hf_model_dir, tmp_path):
    from flowrl.nodes.actor import Actor
    from flowrl.nodes.reference import Reference
    from tests.node_harness import metrics_row

    model = {"type": "hf", "path": hf_model_dir}
    actor = make_node(Actor, {"model": model, "train": {
        "lr": 1e-2, "kl_loss_coef": 0.5, "lora": {**LORA, "reference_from_base": True}}}, name="actor")
    reference = make_node(Reference, {"model": model}, name="reference")
    for s in range(2):
        call(actor.process, node_batch(s), "in")  # train: the adapters are no longer zero
    batch = node_batch(7)
    ref = call(reference.process, batch, "in").tensors["ref_logprobs"]
    own = actor.trainer.base_logprobs(batch.tensors["tokens"], 0.7)
    assert torch.allclose(own.values, ref.values, atol=1e-6, rtol=0)
    trained = packed_logprobs(actor.trainer.model, batch.tensors["tokens"], temperature=0.7)
    assert not torch.allclose(trained.values, ref.values, atol=1e-3)  # the adapters were on, now off
    row = metrics_row(actor, tmp_path)
    assert row["kl_mean"] > 0, sorted(row)  # the KL term ran on the actor's own reference
    published = actor.weights()
    assert published and all(k.endswith((".lora_A", ".lora_B")) for k in published)
