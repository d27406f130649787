"""What both ends of a weight sync must agree on: the names, shapes and dtypes of the tensors.

    layout = layout_of(model.state_dict())                    # [(name, shape, dtype), ...]
    serving = serving_layout(layout, "bfloat16")              # what a bf16 rollout holds
    problem = layout_mismatch(publisher_layout, ours)         # None, or a sentence naming the tensor
    weights_digest(tensors, layout)                           # equal digests = bitwise equal

The publisher may keep fp32 master weights and publish another floating dtype (`serving_dtype`):
its layout on the wire is `serving_layout(master_layout, serving_dtype)`, and that is what every
subscriber must hold. Integer tensors (step counters, index buffers) are never cast.
"""

from __future__ import annotations

import hashlib
from typing import Any

Layout = list[tuple[str, list[int], str]]

FLOATING = {"float64", "float32", "float16", "bfloat16"}


def layout_of(tensors: dict[str, Any]) -> Layout:
    return [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()]


def serving_layout(layout: Layout, serving_dtype: str | None) -> Layout:
    """`layout` with every floating tensor in `serving_dtype` (None: unchanged)."""
    if serving_dtype is None:
        return [(n, list(s), d) for n, s, d in layout]
    serving_dtype = str(serving_dtype).removeprefix("torch.")
    if serving_dtype not in FLOATING:
        raise ValueError(f"serving_dtype {serving_dtype!r} is not a floating dtype; "
                         f"use one of {sorted(FLOATING)} or None to publish the trainer's own dtypes")
    return [(n, list(s), serving_dtype if d in FLOATING else d) for n, s, d in layout]


def layout_digest(layout: Layout) -> str:
    """Equal for equal layouts, whatever order the tensors are listed in."""
    return hashlib.sha256(repr(sorted((n, list(s), d) for n, s, d in layout)).encode()).hexdigest()[:16]


def layout_mismatch(publisher: Layout, subscriber: Layout) -> str | None:
    """None when both layouts are equal, else a sentence naming the first tensor that differs."""
    pub = {n: (list(s), d) for n, s, d in publisher}
    sub = {n: (list(s), d) for n, s, d in subscriber}
    describe = lambda x: f"{x[1]}{x[0]}"  # noqa: E731 - e.g. float32[64, 64]
    for name, _, _ in publisher:
        if name not in sub:
            return (f"tensor {name!r} is published ({describe(pub[name])}) but the subscriber has no such tensor "
                    f"({len(publisher)} tensors published, {len(subscriber)} held)")
        if pub[name] != sub[name]:
            hint = ""
            if pub[name][0] == sub[name][0]:
                hint = (f"; the trainer may keep {pub[name][1]} master weights and publish what the subscriber "
                        f"serves: set serving_dtype={sub[name][1]!r} on the publisher")
            return (f"tensor {name!r} is {describe(pub[name])} on the publisher but {describe(sub[name])} on the "
                    f"subscriber{hint}")
    for name, _, _ in subscriber:
        if name not in pub:
            return f"tensor {name!r} ({describe(sub[name])}) is held by the subscriber but never published"
    return None  # the order may differ: bucket plans sort by name


def weights_digest(tensors: dict[str, Any], layout: Layout) -> str:
    """sha256 over the raw bytes of every tensor, sorted by name: equal digests = bitwise equal."""
    import torch

    h = hashlib.sha256()
    for name, _, _ in sorted(layout):
        t = tensors[name].detach().contiguous().cpu()
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]
