"""`flowrl export` of a LoRA actor: the merged model and the peft adapter folder give the trainer's logits."""

import json

import pytest
import torch

from flowrl.cli import main
from flowrl.export import export_adapter
from flowrl.models import build_model
from flowrl.rl import ActorConfig, ActorTrainer, LoraConfig
from tests.rl.batches import random_batch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    from examples.hf_tiny.make_model import write_model

    return str(write_model(tmp_path_factory.mktemp("base") / "model", "tiny", seed=0, max_len=64))


def lora_run(run_dir, base: str, steps: int = 2) -> ActorTrainer:
    """A run directory as `flowrl run` leaves it (graph.yaml, the actor's committed checkpoint) of a LoRA actor
    trained ``steps`` updates by the real trainer."""
    lora = {"r": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    t = ActorTrainer(build_model({"type": "hf", "path": base}), ActorConfig(lr=2e-2, lora=LoraConfig(**lora)))
    for s in range(steps):
        b = random_batch(build_model({"type": "hf", "path": base}), 8, seed=s)
        t.train_step(tokens=b["tokens"], loss_mask=b["loss_mask"], old_logprobs=b["old_logprobs"],
                     advantages=b["advantages"])
    (run_dir / "checkpoints" / "step00000002").mkdir(parents=True)
    model = json.dumps({"type": "hf", "path": base})
    (run_dir / "graph.yaml").write_text(f"name: t\nnodes:\n  actor: {{kind: actor, config: {{model: {model}, "
                                        f"train: {{lora: {json.dumps(lora)}}}}}}}\n")
    name = "step00000002/actor.0.0.e0.pt"  # the runtime's layout (flowrl/runtime/protocol/checkpoints.py)
    torch.save({"node": t.state_dict(), "version": 2, "step": 2, "epoch": 0}, run_dir / "checkpoints" / name)
    for f in ("step00000002/commit.json", "latest.json"):
        (run_dir / "checkpoints" / f).write_text(json.dumps({"step": 2, "files": {"actor/0/0": name}}))
    return t


def logits_of(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.timeout(300)
def test_merged_and_adapter_exports_load_back_with_the_trainers_logits(tmp_path, base):
    t = lora_run(tmp_path / "run", base)
    tokens = torch.randint(0, 18, (3, 12), generator=torch.Generator().manual_seed(3))
    want = logits_of(t.model.eval(), tokens)
    plain = logits_of(transformers.AutoModelForCausalLM.from_pretrained(base).eval(), tokens)
    assert not torch.allclose(want, plain, atol=1e-3)  # the adapters changed the policy

    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(logits_of(merged, tokens), want, atol=2e-5, rtol=1e-5)
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()

    assert main(["export", str(tmp_path / "run"), "--adapter", str(tmp_path / "adapter")]) == 0
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base),
                                            str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(logits_of(loaded, tokens), want, atol=2e-5, rtol=1e-5)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4


@pytest.mark.timeout(300)
def test_export_refuses_another_base_and_adapters_of_a_full_run(tmp_path, capsys):
    from examples.hf_tiny.make_model import write_model

    base = str(write_model(tmp_path / "base", "tiny", seed=0, max_len=64))
    lora_run(tmp_path / "run", base, steps=1)
    moved = build_model({"type": "hf", "path": base}).backbone
    with torch.no_grad():
        moved.model.norm.weight.add_(0.5)
    moved.save_pretrained(base)  # the base folder now holds other weights than the adapters were trained on
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "o")]) == 1
    assert "load the base they were trained on" in capsys.readouterr().err

    from tests.export.test_export import fake_run

    fake_run(tmp_path / "full", {"type": "tiny", "d_model": 16, "n_heads": 2})
    with pytest.raises(ValueError, match="no train.lora.*export it with --hf"):
        export_adapter(tmp_path / "full", tmp_path / "o2")
