"""LoRA on a model: adapters injected with peft, the frozen base, and the weights an adapter sync sends.

    pip install 'flowrl[lora]'
    apply_lora(model, lora, seed=0)     # in place: base frozen, adapters trainable (B = 0: no change yet)
    adapter_weights(model)              # {"P.lora_A": [r, in], "P.lora_B": [out, r] * alpha / r} (flowrl.weights.adapters)
    merged_state(model)                 # the effective full weights, named as the plain model's state dict
    with adapters_disabled(model): ...  # the frozen base alone (the reference policy)
    base_reference(model)               # {"path", "fingerprint"}: which base the adapters belong to

``lora`` is anything with ``r``, ``alpha``, ``target_modules`` and ``dropout``
(:class:`flowrl.rl.config.LoraConfig`). The adapters are injected in place
(``peft.inject_adapter_in_model``): the model keeps its class and methods (``forward_packed``, the
KV cache), and each adapted ``nn.Linear`` named ``P`` becomes peft's layer whose base weight sits at
``P.base_layer.weight``. The plain names (``P.weight``, what a full sync and the rollouts use) are
recovered by dropping ``.base_layer`` (and the ``base_model.model.`` prefix of a ``PeftModel``).
peft is imported when adapters are applied, never when flowrl is.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

ADAPTER = "default"
"""The one adapter a model carries (peft's default name)."""


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError("train.lora needs the peft package: pip install 'flowrl[lora]' (or pip install peft)") \
            from None
    return peft


def apply_lora(model: nn.Module, lora: Any, *, seed: int = 0) -> nn.Module:
    """Inject adapters into every ``nn.Linear`` whose last name part is in ``lora.target_modules``.

    Everything else is frozen (``requires_grad=False``). The A matrices are drawn from ``seed`` (the
    global RNG is left as it was), the B matrices are zero, so the model computes what it did."""
    peft = _peft()
    if any(True for _ in lora_layers(model)):
        raise ValueError("the model already carries LoRA adapters; apply_lora takes a plain model")
    linears = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    missing = sorted(set(lora.target_modules) - set(linears))
    if missing:
        raise ValueError(f"lora.target_modules {missing} name no linear layer of the model; its linear layers are "
                         f"{linears} (set train.lora.target_modules to some of them)")
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                             lora_dropout=lora.dropout, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name))
    return model


def is_adapter_param(name: str) -> bool:
    """A parameter (or state dict entry) of an adapter, not of the base."""
    return ".lora_A." in name or ".lora_B." in name


def plain_name(name: str) -> str:
    """A LoRA model's module or state dict name -> the plain model's (``base_model.model.``, ``.base_layer`` dropped)."""
    return name.replace("base_model.model.", "", 1).replace(".base_layer", "")


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, layer)`` of every adapted layer (peft's LoRA layers), in module order."""
    for name, m in model.named_modules():
        if isinstance(getattr(m, "lora_A", None), nn.ModuleDict) and hasattr(m, "base_layer"):
            yield name, m


def has_lora(model: nn.Module) -> bool:
    return any(True for _ in lora_layers(model))


def adapter_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an adapter-only weight version carries (see :mod:`flowrl.weights.adapters`): for the layer
    whose full weight is ``P.weight``, ``P.lora_A`` as trained and ``P.lora_B`` times ``alpha / r``.

    Sharded (FSDP2) the tensors are DTensors (B scaled shard by shard); ``FullState`` gathers them."""
    out = {}
    for name, layer in lora_layers(model):
        stem = plain_name(name)
        out[stem + ".lora_A"] = layer.lora_A[ADAPTER].weight.detach()
        out[stem + ".lora_B"] = layer.lora_B[ADAPTER].weight.detach() * float(layer.scaling[ADAPTER])
    if not out:
        raise ValueError("the model has no LoRA adapters (train.lora is not set); publish its full state instead")
    return out


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base weights under the plain model's names (no adapter entries)."""
    return {plain_name(k): v for k, v in model.state_dict().items() if not is_adapter_param(k)}


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The effective full weights (base + scaled B @ A on every adapted layer), named as the plain model's
    state dict: what a full sync of the same policy would send. One rank (no sharding)."""
    from flowrl.weights.adapters import merged

    return merged(base_state(model), adapter_weights(model))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base alone inside the block: every LoRA layer computes its base layer's output.

    The flag is set on the layers directly: peft's ``enable_adapters`` would also flip ``requires_grad``
    on the adapters, which a sharded (FSDP2) trainer must not see change."""
    layers = [m for _, m in lora_layers(model)]
    before = [m._disable_adapters for m in layers]
    try:
        for m in layers:
            m._disable_adapters = True
        yield model
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


def base_reference(model: nn.Module) -> dict[str, Any]:
    """Which base the adapters belong to: the folder it was loaded from (``source_path``, when known) and
    a fingerprint of its weights (sha256 over every base tensor's name, shape, dtype and up to 1024
    evenly spaced values). Call it on an unsharded model; it reads every base tensor once (no copies)."""
    digest = hashlib.sha256()
    for name, t in sorted(base_state(model).items()):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // 1024)
        sample = flat[::step][:1024].to(device="cpu", dtype=torch.float64)
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}:".encode())
        digest.update(sample.numpy().tobytes())
    return {"path": getattr(model, "source_path", None), "fingerprint": digest.hexdigest()[:32]}


def check_same_base(saved: dict[str, Any], here: dict[str, Any], what: str = "checkpoint") -> None:
    """Refuse adapters trained on another base than ``here`` (clear error naming both)."""
    if saved.get("fingerprint") != here.get("fingerprint"):
        raise ValueError(
            f"the {what}'s LoRA adapters were trained on the base {saved.get('path')!r} (fingerprint "
            f"{saved.get('fingerprint')}), but this model's base {here.get('path')!r} has fingerprint "
            f"{here.get('fingerprint')}: load the base they were trained on (model.path)"
        )
