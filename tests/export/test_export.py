"""`flowrl export`: a checkpointed tiny policy becomes a GPT-2 folder that transformers loads with the same logits."""

import json

import pytest
import torch

from flowrl.cli import main
from flowrl.data import CharTokenizer
from flowrl.export import CheckpointError, export_hf, load_checkpoint_state
from flowrl.models import TinyLMSpec, build_model

transformers = pytest.importorskip("transformers")


def fake_run(run_dir, spec: dict, steps=(3, 6), seed=0):
    """A run directory as `flowrl run` leaves it: graph.yaml and the actor's committed checkpoints."""
    (run_dir / "checkpoints").mkdir(parents=True)
    model_yaml = json.dumps(spec)
    (run_dir / "graph.yaml").write_text(f"name: t\nnodes:\n  actor: {{kind: actor, config: {{model: {model_yaml}}}}}\n")
    models = {}
    for step in steps:
        model = build_model(spec, seed=seed)
        with torch.no_grad():  # trained-looking weights, far from the near-uniform init
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * 0.5)
        name = f"step{step:08d}/actor.0.0.e0.pt"  # the runtime's layout (flowrl/runtime/protocol/checkpoints.py)
        (run_dir / "checkpoints" / name).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"node": {"model": model.state_dict(), "steps": step}, "version": step, "step": step, "epoch": 0},
                   run_dir / "checkpoints" / name)
        (run_dir / "checkpoints" / f"step{step:08d}" / "commit.json").write_text(
            json.dumps({"step": step, "files": {"actor/0/0": name}}))
        models[step] = model.eval()
    (run_dir / "checkpoints" / "latest.json").write_text(json.dumps(
        {"step": steps[-1], "files": {"actor/0/0": f"step{steps[-1]:08d}/actor.0.0.e0.pt"}}))
    return models


@pytest.mark.parametrize("spec", [
    {"type": "tiny", "vocab_size": 102, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 40},
    {"type": "tiny", "d_model": 16, "n_layers": 1, "n_heads": 2, "mlp_ratio": 2, "tie_embeddings": True},
], ids=["text-vocab", "task-vocab-tied"])
def test_the_exported_model_gives_the_same_logits_in_transformers(tmp_path, spec):
    models = fake_run(tmp_path / "run", spec)
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, TinyLMSpec(**spec).vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, models[6](tokens), atol=1e-5, rtol=0)


def test_a_chosen_step_is_exported_and_the_tokenizer_matches_flowrls(tmp_path):
    spec = {"type": "tiny", "vocab_size": 102, "d_model": 32, "n_layers": 1, "n_heads": 4, "max_seq_len": 64}
    models = fake_run(tmp_path / "run", spec)
    export_hf(tmp_path / "run", tmp_path / "hf", step=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Ann has 3 cups and gets 4 more.\nHow many cups?="
    ids = tok(text)["input_ids"]
    assert ids == CharTokenizer().encode(text) and tok.decode(ids, skip_special_tokens=True) == text
    with torch.no_grad():
        assert torch.allclose(hf(torch.tensor([ids])).logits, models[3](torch.tensor([ids])), atol=1e-5, rtol=0)


def test_missing_checkpoints_and_rotary_models_are_refused_with_the_reason(tmp_path):
    with pytest.raises(CheckpointError, match="committed no checkpoint"):
        load_checkpoint_state(tmp_path, "actor")
    fake_run(tmp_path / "run", {"type": "tiny", "d_model": 16, "n_heads": 2})
    with pytest.raises(CheckpointError, match=r"kept: step00000003, step00000006"):
        load_checkpoint_state(tmp_path / "run", "actor", step=4)
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "o"), "--node", "critic"]) == 1
    fake_run(tmp_path / "rope", {"type": "tiny", "d_model": 16, "n_heads": 2, "positions": "rope"})
    with pytest.raises(ValueError, match="positions: rope"):
        export_hf(tmp_path / "rope", tmp_path / "o2")
