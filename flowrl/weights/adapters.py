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

A receiver checks an adapter layout against its own weights (`adapter_mismatch`, at join) and
applies versions with `AdaptedWeights`, which keeps the base of the adapted tensors only, so that
version k serves base + B_k A_k, never the sum of every version so far (docs/weight-sync.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from flowrl.weights.layout import Layout

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


def similar(weight: str, names: Iterable[str]) -> list[str]:
    """Up to three of ``names`` for the same kind of layer as ``weight`` (``...q_proj.weight``): what
    an error about a target the model does not hold suggests instead."""
    stem = weight.rsplit(".", 2)[-2] if weight.count(".") >= 2 else weight
    return [n for n in names if f".{stem}." in f".{n}"][:3]


def fits(weight: Iterable[int], lora_a: Iterable[int], lora_b: Iterable[int]) -> bool:
    """Whether adapters of shapes A ``[r, in]`` and B ``[out, r]`` fit a weight of shape ``[out, in]``."""
    w, a, b = list(weight), list(lora_a), list(lora_b)
    return len(w) == len(a) == len(b) == 2 and a[1] == w[1] and b[0] == w[0] and a[0] == b[1]


def effective(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """``base + lora_B @ lora_A`` in ``base``'s dtype (computed in float32)."""
    if not fits(base.shape, lora_a.shape, lora_b.shape):
        raise ValueError(f"adapter shapes A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} do not fit a weight of "
                         f"shape {tuple(base.shape)} (need A [r, in], B [out, r])")
    delta = lora_b.to(torch.float32) @ lora_a.to(torch.float32)
    return (base.to(torch.float32) + delta).to(base.dtype)


def merged(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weights ``base`` serves with ``adapters`` applied (only adapted entries are new tensors)."""
    out = dict(base)
    for weight, (a, b) in adapter_targets(adapters).items():
        if weight not in base:
            raise KeyError(f"adapter targets {weight!r}, which the model does not have (similar: "
                           f"{similar(weight, base)})")
        out[weight] = effective(base[weight], adapters[a], adapters[b])
    return out


def adapter_mismatch(adapters: Layout, full: Layout) -> str | None:
    """None when every adapter of the layout ``adapters`` fits a tensor of the layout ``full`` (a
    receiver's own weights), else a sentence naming the first that does not and how to fix it."""
    held = {n: list(s) for n, s, _ in full}
    shapes = {n: list(s) for n, s, _ in adapters}
    try:
        targets = adapter_targets(shapes)
    except ValueError as e:
        return str(e)
    for weight, (a, b) in targets.items():
        if weight not in held:
            return (f"the publisher's adapter targets {weight!r}, which the subscriber does not hold (similar: "
                    f"{similar(weight, held)}); "
                    "trainer and rollout must build the same model, and the adapter names must be "
                    "`<full weight name without .weight>.lora_A/.lora_B`")
        w, sa, sb = held[weight], shapes[a], shapes[b]
        if not fits(w, sa, sb):
            return (f"adapter of {weight!r} does not fit it: {a} is {sa} and {b} is {sb}, but the subscriber's "
                    f"weight is {w} (need A [r, in], B [out, r]); trainer and rollout must build the same model")
    return None


class AdaptedWeights:
    """The base weights under adapter versions, so that versions never accumulate.

        adapted = AdaptedWeights()
        adapted.apply(live, version_1)    # live[P.weight] = base + B1 @ A1 (base copied on first touch)
        adapted.apply(live, version_2)    # live[P.weight] = base + B2 @ A2, not base + B1 A1 + B2 A2
        adapted.forget(names)             # a full version replaced these: their base is the new value

    Only adapted tensors are copied (memory: one more copy of the targeted weights). A tensor the
    previous version adapted and this one does not goes back to its base. `updates` computes a
    whole version before anything changes: an unknown name or a shape that does not fit raises
    with ``live`` and the base copies untouched.
    """

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}

    def updates(self, live: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name: new value}`` for every tensor of ``live`` that this adapter version changes."""
        targets = adapter_targets(adapters)
        out: dict[str, torch.Tensor] = {}
        for weight, (a, b) in targets.items():
            if weight not in live:
                raise KeyError(f"adapter targets {weight!r}, which the model does not have (similar: "
                               f"{similar(weight, live)}); nothing was applied")
            base = self.base.get(weight)
            try:
                out[weight] = effective(live[weight] if base is None else base, adapters[a], adapters[b])
            except ValueError as e:
                raise ValueError(f"adapter of {weight!r}: {e}; nothing was applied") from None
        for weight, base in self.base.items():
            if weight not in targets and weight in live:
                out[weight] = base
        return out

    def remember(self, live: Mapping[str, torch.Tensor], updates: Mapping[str, torch.Tensor]) -> None:
        """Copy the base of every tensor ``updates`` adapts for the first time (before it changes)."""
        for name in updates:
            if name not in self.base:
                self.base[name] = live[name].detach().clone()

    def settle(self, adapters: Mapping[str, torch.Tensor]) -> None:
        """After a version landed: drop the base copies of tensors it no longer adapts (back at base)."""
        keep = set(adapter_targets(adapters))
        self.base = {k: v for k, v in self.base.items() if k in keep}

    def apply(self, live: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]) -> int:
        """Write ``base + B @ A`` into the live tensors (in place, whole or not at all); returns the
        number of tensors written."""
        updates = self.updates(live, adapters)
        self.remember(live, updates)
        with torch.no_grad():
            for name, value in updates.items():
                live[name].copy_(value)
        self.settle(adapters)
        return len(updates)

    def forget(self, names: Iterable[str]) -> None:
        """A full version wrote these tensors: what they hold now is their base."""
        for name in names:
            self.base.pop(name, None)
