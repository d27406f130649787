"""LoRA adapter versions on the wire: what an adapter-only weight sync carries, and how it applies.

A trainer with LoRA publishes only its adapters. For each adapted linear layer whose full weight is
``P.weight`` in the model's state dict (the name the full sync would use), the version carries:

    P.lora_A    [r, in_features]     as trained
    P.lora_B    [out_features, r]    already multiplied by the scaling alpha / r

so the effective weight a rollout must serve is ``W_base[P.weight] + lora_B @ lora_A`` — no LoRA
config travels, and a receiver needs nothing but its own base weights. Dropout does not exist at
inference. A version is either all adapters (an adapter version) or none (a full version).

    names = adapter_targets(version.keys())          # {"P.weight": ("P.lora_A", "P.lora_B"), ...}
    merged = effective(base["P.weight"], version["P.lora_A"], version["P.lora_B"])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"


def is_adapter_name(name: str) -> bool:
    return name.endswith((A_SUFFIX, B_SUFFIX))


def base_name(name: str) -> str:
    """``P.lora_A`` / ``P.lora_B`` -> ``P.weight``, the full weight the pair adapts."""
    if not is_adapter_name(name):
        raise ValueError(f"{name!r} is not an adapter tensor name (it must end in {A_SUFFIX} or {B_SUFFIX})")
    return name.rsplit(".", 1)[0] + ".weight"


def is_adapter_version(names: Iterable[str]) -> bool:
    """True when every name is an adapter tensor; a mix of adapters and full weights is an error."""
    names = list(names)
    flags = {is_adapter_name(n) for n in names}
    if len(flags) > 1:
        full = [n for n in names if not is_adapter_name(n)][:3]
        raise ValueError(f"a weight version mixes adapter tensors with full weights ({full}); publish either "
                         "the adapters only (LoRA) or the full state")
    return flags == {True}


def adapter_targets(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``{"P.weight": ("P.lora_A", "P.lora_B")}`` for every adapted layer; each needs both halves."""
    pairs: dict[str, set[str]] = {}
    for name in names:
        pairs.setdefault(base_name(name), set()).add(name)
    out = {}
    for weight, got in sorted(pairs.items()):
        stem = weight[: -len(".weight")]
        a, b = stem + A_SUFFIX, stem + B_SUFFIX
        if got != {a, b}:
            raise ValueError(f"adapter of {weight!r} is incomplete: got {sorted(got)}, need {a!r} and {b!r}")
        out[weight] = (a, b)
    return out


def effective(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """``base + lora_B @ lora_A`` in ``base``'s dtype (computed in float32)."""
    if lora_b.shape[0] != base.shape[0] or lora_a.shape[1] != base.shape[1] or lora_a.shape[0] != lora_b.shape[1]:
        raise ValueError(f"adapter shapes A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} do not fit a weight of "
                         f"shape {tuple(base.shape)} (need A [r, in], B [out, r])")
    delta = lora_b.to(torch.float32) @ lora_a.to(torch.float32)
    return (base.to(torch.float32) + delta).to(base.dtype)


def merged(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weights ``base`` serves with ``adapters`` applied (only adapted entries are new tensors)."""
    out = dict(base)
    for weight, (a, b) in adapter_targets(adapters).items():
        if weight not in base:
            close = [k for k in base if k.endswith(weight.rsplit(".", 2)[-2] + ".weight")][:3]
            raise KeyError(f"adapter targets {weight!r}, which the model does not have (similar: {close})")
        out[weight] = effective(base[weight], adapters[a], adapters[b])
    return out
