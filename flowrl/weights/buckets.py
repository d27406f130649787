"""Pack named tensors into a few large flat buffers (one dtype each) and back.

A broadcast per tensor costs a round of latency per tensor; a few large buckets cost almost only
bandwidth. Both sides derive the same layout from their own model (same names, shapes, dtypes in
the same order), so the subscriber allocates its buffers without asking the publisher. Packing
bucket i+1 overlaps the broadcast of bucket i (see `WeightGroup.broadcast`).

    plan = BucketPlan(layout_of(model.state_dict()), bucket_bytes=32 << 20)
    buckets = plan.allocate(live=model.state_dict())   # once; reused for every version
    plan.fill(i, buckets, tensors)            # publisher: copy the tensors of bucket i in
    plan.drain(i, buckets, live)              # subscriber: copy bucket i into the live tensors

A tensor of at least `direct_bytes` travels alone, in place: on a subscriber its bucket *is* the
model's own (contiguous) tensor, so the broadcast writes the weights where they are used and
nothing is copied afterwards.
"""

from __future__ import annotations

import hashlib
from typing import Any

Layout = list[tuple[str, list[int], str]]


def layout_of(tensors: dict[str, Any]) -> Layout:
    return [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()]


def layout_digest(layout: Layout) -> str:
    return hashlib.sha256(repr([tuple(x) for x in layout]).encode()).hexdigest()[:16]


def weights_digest(tensors: dict[str, Any], layout: Layout) -> str:
    """sha256 over the raw bytes of every tensor, in layout order: equal digests = bitwise equal."""
    h = hashlib.sha256()
    for name, _, _ in layout:
        t = tensors[name].detach().contiguous().cpu()
        h.update(t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()[:32]


class BucketPlan:
    """Which tensor lives where: tensors grouped by dtype, in layout order, into buckets of at
    most `bucket_bytes` (a larger tensor gets a bucket of its own)."""

    def __init__(self, layout: Layout, bucket_bytes: int = 32 << 20, direct_bytes: int = 4 << 20):
        import torch

        self.layout = [tuple(x) for x in layout]
        self.bucket_bytes = bucket_bytes
        by_dtype: dict[str, list] = {}
        for name, shape, dtype in self.layout:
            by_dtype.setdefault(dtype, []).append((name, list(shape)))
        # buckets: [(dtype, [(name, shape, offset, numel)], total numel)]
        self.buckets: list[tuple[str, list[tuple[str, list[int], int, int]], int]] = []
        self.direct: set[int] = set()  # buckets holding one large tensor
        for dtype, items in by_dtype.items():
            itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            current, offset = [], 0
            for name, shape in items:
                numel = 1
                for d in shape:
                    numel *= d
                if numel * itemsize >= direct_bytes:
                    self.buckets.append((dtype, [(name, shape, 0, numel)], numel))
                    self.direct.add(len(self.buckets) - 1)
                    continue
                if current and (offset + numel) * itemsize > bucket_bytes:
                    self.buckets.append((dtype, current, offset))
                    current, offset = [], 0
                current.append((name, shape, offset, numel))
                offset += numel
            if current:
                self.buckets.append((dtype, current, offset))

    def __len__(self) -> int:
        return len(self.buckets)

    def allocate(self, device: str = "cpu", live: dict[str, Any] | None = None) -> list:
        """One flat buffer per bucket; with `live`, a large contiguous tensor is its own buffer."""
        import torch

        out = []
        for i, (dtype, items, n) in enumerate(self.buckets):
            t = live.get(items[0][0]) if live is not None and i in self.direct else None
            if t is not None and t.is_contiguous() and str(t.dtype).removeprefix("torch.") == dtype:
                out.append(t.detach().view(-1))
            else:
                out.append(torch.empty(n, dtype=getattr(torch, dtype), device=device))
        return out

    def fill(self, i: int, buckets: list, tensors: dict[str, Any]) -> None:
        bucket = buckets[i]
        for name, _, offset, numel in self.buckets[i][1]:
            src = tensors[name].detach()
            if src.data_ptr() != bucket.data_ptr() or offset:
                bucket[offset:offset + numel].copy_(src.reshape(-1))

    def drain(self, i: int, buckets: list, live: dict[str, Any]) -> None:
        """Copy bucket i into the live tensors (nothing to do for a tensor received in place)."""
        self.fill_from(i, buckets, live)

    def fill_from(self, i: int, buckets: list, live: dict[str, Any]) -> None:
        bucket = buckets[i]
        for name, shape, offset, numel in self.buckets[i][1]:
            dst = live[name]
            if dst.data_ptr() != bucket.data_ptr() or offset:
                dst.detach().copy_(bucket[offset:offset + numel].view(shape))

    def pack(self, tensors: dict[str, Any], out: list | None = None) -> list:
        buckets = out if out is not None else self.allocate(str(next(iter(tensors.values())).device))
        for i in range(len(self.buckets)):
            self.fill(i, buckets, tensors)
        return buckets

    def views(self, buckets: list) -> dict[str, Any]:
        """Views into the buckets, one per tensor, shaped as the layout says (no copy)."""
        out = {}
        for bucket, (_, items, _) in zip(buckets, self.buckets):
            for name, shape, offset, numel in items:
                out[name] = bucket[offset:offset + numel].view(shape)
        return out

    def bucket_views(self, i: int, buckets: list) -> dict[str, Any]:
        bucket = buckets[i]
        return {name: bucket[offset:offset + numel].view(shape) for name, shape, offset, numel in self.buckets[i][1]}
