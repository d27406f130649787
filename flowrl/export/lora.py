"""Export of a LoRA actor: the merged model, or the adapters as a peft folder.

    flowrl export RUN_DIR --hf OUT         # base + adapters merged: a plain Hugging Face model folder
    flowrl export RUN_DIR --adapter OUT    # adapter_config.json + adapter_model.safetensors

    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUT)

A LoRA checkpoint holds the adapters, their config (``lora``) and which base they belong to
(``base``: its folder and a fingerprint of its weights); the base is read from the run's model spec
and refused when its fingerprint differs. A data-parallel actor (``devices: N``) saved each rank's
shard of every adapter (FSDP2 shards along dim 0): :func:`whole_adapters` reads every rank's file
and concatenates the shards in rank order.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any


def is_lora_state(state: dict[str, Any]) -> bool:
    return "lora" in state and "base" in state


def whole_adapters(run_dir: Path, node: str, step: int | None, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (rank 0's) with every adapter tensor made whole from all the ranks' checkpoints."""
    import torch

    from flowrl.export.checkpoints import load_checkpoint_state

    rank, world = state.get("ranks", [0, 1])
    if world == 1:
        return state
    parts = [state] + [load_checkpoint_state(run_dir, node, step, rank=r) for r in range(1, world)]
    model = {k: torch.cat([p["model"][k] for p in parts], dim=0) for k in state["model"]}
    return {**state, "model": model, "ranks": [0, 1]}


def lora_model(state: dict[str, Any], spec: Any) -> Any:
    """The actor's model as trained: the base of ``spec`` with the checkpoint's adapters (checked base)."""
    from flowrl.models import build_model
    from flowrl.models.lora import apply_lora, base_reference, check_same_base

    if spec.type != "hf":
        raise ValueError(f"a LoRA checkpoint needs its Hugging Face base, but the run's model is {spec.type!r}")
    model = build_model(spec)
    apply_lora(model, SimpleNamespace(**state["lora"]))
    check_same_base(state["base"], base_reference(model))
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if ".lora_" in k]
    if missing or unexpected:
        raise ValueError(f"the checkpoint's adapters do not fit the model: missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}")
    return model.eval()


def _base(spec: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec.path, local_files_only=True,
                                                trust_remote_code=spec.trust_remote_code)


def _tokenizer(spec: Any, out: Path) -> None:
    if (Path(spec.path) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(spec.path, local_files_only=True).save_pretrained(str(out))


def export_merged(state: dict[str, Any], spec: Any, out: Path) -> Path:
    """Base + adapters merged into the base's own class, saved with the base's tokenizer."""
    from flowrl.models.lora import merged_state

    weights = {k.removeprefix("backbone."): v for k, v in merged_state(lora_model(state, spec)).items()}
    model = _base(spec)
    model.load_state_dict(weights, strict=True)
    model.save_pretrained(str(out), safe_serialization=True)
    _tokenizer(spec, out)
    return out


def export_adapter(state: dict[str, Any], spec: Any, out: Path) -> Path:
    """The adapters as peft saves them (``PeftModel.from_pretrained(base, out)`` loads them)."""
    import torch

    from flowrl.models.lora import _peft

    trained = lora_model(state, spec).state_dict()
    peft, lora = _peft(), state["lora"]
    config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=list(lora["target_modules"]),
                             lora_dropout=lora["dropout"], bias="none")
    model = peft.get_peft_model(_base(spec), config)
    copied = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(trained["backbone." + name.removeprefix("base_model.model.")])
                copied += 1
    if copied != sum(".lora_" in k for k in trained):
        raise RuntimeError(f"copied {copied} adapter tensors of {sum('.lora_' in k for k in trained)}")
    model.save_pretrained(str(out))
    _tokenizer(spec, out)
    return out
