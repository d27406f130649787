"""`flowrl export RUN_DIR --hf OUT [--step N] [--node actor]`: a trained policy as a Hugging Face folder.

`flowrl export RUN_DIR --adapter OUT`: a LoRA actor's adapters as a peft folder (`--hf` writes its
base with the adapters merged); see :mod:`flowrl.export.lora` and docs/lora.md.

    from flowrl.export import export_hf, load_checkpoint_state
    export_hf("runs/grpo-math-...", "out/grpo-math")          # config.json, model.safetensors, tokenizer

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("out/grpo-math")

The policy's weights come from the node's checkpoint (:func:`load_checkpoint_state`), its model
spec from ``RUN_DIR/graph.yaml``. The built-in tiny model becomes a GPT-2 (exact mapping, see
:mod:`flowrl.export.hf`) with a character tokenizer; a Hugging Face model is saved with its own
class and the tokenizer of the folder it was loaded from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrl.export.checkpoints import (
    CheckpointError,
    checkpoint_path,
    load_checkpoint_state,
)

__all__ = ["CheckpointError", "checkpoint_path", "export_adapter", "export_hf", "load_checkpoint_state",
           "model_spec_of"]


def model_spec_of(run_dir: str | Path, node: str) -> Any:
    """The model spec of ``node`` in the run's resolved graph."""
    from flowrl.graph import load_graph
    from flowrl.models import parse_model_spec

    spec = load_graph(Path(run_dir) / "graph.yaml", check=False)
    if node not in spec.nodes:
        raise ValueError(f"the run has no node {node!r}; its nodes are {sorted(spec.nodes)}")
    model = spec.nodes[node].config.get("model")
    if model is None:
        raise ValueError(f"node {node!r} has no `model` in its config; export the node that trains the policy")
    return parse_model_spec(model)


def export_hf(run_dir: str | Path, out: str | Path, *, node: str = "actor", step: int | None = None) -> Path:
    """Write the policy of ``node`` at ``step`` (default: last checkpoint) to ``out``; returns ``out``."""
    state = load_checkpoint_state(run_dir, node, step)
    weights = state.get("model", state)
    spec = model_spec_of(run_dir, node)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from flowrl.export.lora import export_merged, is_lora_state, whole_adapters

    if is_lora_state(state):
        return export_merged(whole_adapters(Path(run_dir), node, step, state), spec, out)
    if spec.type == "tiny":
        from transformers import GPT2LMHeadModel

        from flowrl.export.hf import gpt2_config, tiny_to_gpt2
        from flowrl.export.tokenizer import save_char_tokenizer

        model = GPT2LMHeadModel(gpt2_config(spec))
        missing, unexpected = model.load_state_dict(tiny_to_gpt2(weights, spec), strict=False)
        missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]  # causal-mask buffers
        if missing or unexpected:
            raise RuntimeError(f"export mapping is incomplete: missing {missing}, unexpected {unexpected}")
        model.save_pretrained(str(out), safe_serialization=True)
        save_char_tokenizer(out, spec.vocab_size)
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(spec.path, local_files_only=True,
                                                 trust_remote_code=spec.trust_remote_code)
    inner = {k.removeprefix("backbone."): v for k, v in weights.items()}
    model.load_state_dict(inner, strict=True)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(spec.path, local_files_only=True).save_pretrained(str(out))
    return out


def export_adapter(run_dir: str | Path, out: str | Path, *, node: str = "actor", step: int | None = None) -> Path:
    """Write the LoRA adapters of ``node`` at ``step`` as a peft folder to ``out``; returns ``out``."""
    from flowrl.export.lora import export_adapter as write, is_lora_state, whole_adapters

    state = load_checkpoint_state(run_dir, node, step)
    if not is_lora_state(state):
        raise ValueError(f"node {node!r} of {run_dir} trained the whole model (no train.lora): it has no adapters; "
                         "export it with --hf")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return write(whole_adapters(Path(run_dir), node, step, state), model_spec_of(run_dir, node), out)
