"""Pack named tensors into a few large flat buffers (one dtype each) and back.

A broadcast per tensor costs a round of latency per tensor; a few large buckets cost almost only
bandwidth. Both sides derive the same layout from their own model (same names, shapes, dtypes in
the same order), so the subscriber allocates its buffers without asking the publisher.

    layout = layout_of(model.state_dict())          # [(name, shape, dtype), ...]
    buckets = pack(tensors, layout, bucket_bytes)   # [flat tensor, ...]
    tensors = unpack(buckets, layout, bucket_bytes) # {name: view into a bucket}
"""

from __future__ import annotations

import hashlib
from typing import Any

Layout = list[tuple[str, list[int], str]]


def layout_of(tensors: dict[str, Any]) -> Layout:
    return [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()]


def layout_digest(layout: Layout) -> str:
    return hashlib.sha256(repr(layout).encode()).hexdigest()[:16]


def plan_buckets(layout: Layout, bucket_bytes: int) -> list[tuple[str, list[tuple[str, list[int], int, int]]]]:
    """Group tensors by dtype, in layout order, into buckets of at most `bucket_bytes` (a tensor
    larger than that gets a bucket of its own). Returns [(dtype, [(name, shape, offset, numel)])]."""
    import torch

    by_dtype: dict[str, list] = {}
    for name, shape, dtype in layout:
        by_dtype.setdefault(dtype, []).append((name, shape))
    out = []
    for dtype, items in by_dtype.items():
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        current, offset = [], 0
        for name, shape in items:
            numel = 1
            for d in shape:
                numel *= d
            if current and (offset + numel) * itemsize > bucket_bytes:
                out.append((dtype, current))
                current, offset = [], 0
            current.append((name, shape, offset, numel))
            offset += numel
        if current:
            out.append((dtype, current))
    return out


def empty_buckets(layout: Layout, bucket_bytes: int, device: str = "cpu") -> list:
    import torch

    plan = plan_buckets(layout, bucket_bytes)
    return [torch.empty(sum(n for *_, n in items), dtype=getattr(torch, dtype), device=device) for dtype, items in plan]


def pack(tensors: dict[str, Any], layout: Layout, bucket_bytes: int, out: list | None = None) -> list:
    """Copy `tensors` into flat buckets (reusing `out` when given)."""
    plan = plan_buckets(layout, bucket_bytes)
    buckets = out if out is not None else empty_buckets(layout, bucket_bytes, str(next(iter(tensors.values())).device))
    for bucket, (_, items) in zip(buckets, plan):
        for name, _, offset, numel in items:
            bucket[offset:offset + numel].copy_(tensors[name].detach().reshape(-1))
    return buckets


def unpack(buckets: list, layout: Layout, bucket_bytes: int) -> dict[str, Any]:
    """Views into the buckets, one per tensor, shaped as the layout says (no copy)."""
    plan = plan_buckets(layout, bucket_bytes)
    out = {}
    for bucket, (_, items) in zip(buckets, plan):
        for name, shape, offset, numel in items:
            out[name] = bucket[offset:offset + numel].view(shape)
    return out
