"""Bucket plans: large tensors travel alone and in place, small ones packed, nothing lost."""

import torch

from flowrl.weights import BucketPlan, layout_digest, layout_of


def model_like():
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(512, 1024, generator=g),  # 2 MiB: direct at 1 MiB
        "l0.w": torch.randn(64, 64, generator=g),
        "l0.b": torch.randn(64, generator=g),
        "l0.h": torch.randn(64, generator=g).half(),
        "l1.w": torch.randn(64, 64, generator=g),
        "step": torch.tensor(3, dtype=torch.int64),
    }


def test_pack_then_drain_reproduces_every_tensor_bitwise():
    src = model_like()
    plan = BucketPlan(layout_of(src), bucket_bytes=20_000, direct_bytes=1 << 20)
    sent = plan.pack(src)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    received = plan.allocate(live=dst)
    for s, r in zip(sent, received):
        r.copy_(s)  # what the broadcast does
    for i in range(len(plan)):
        plan.drain(i, received, dst)
    for k in src:
        assert torch.equal(src[k], dst[k]), k


def test_large_tensors_are_received_in_place_and_small_ones_bucketed_by_dtype():
    live = model_like()
    plan = BucketPlan(layout_of(live), bucket_bytes=20_000, direct_bytes=1 << 20)
    buckets = plan.allocate(live=live)
    direct = [i for i in range(len(plan)) if i in plan.direct]
    assert len(direct) == 1 and buckets[direct[0]].data_ptr() == live["emb"].data_ptr()
    dtypes = [d for d, _, _ in plan.buckets]
    assert "float16" in dtypes and "int64" in dtypes
    assert all(n * buckets[i].element_size() <= 20_000 for i, (_, items, n) in enumerate(plan.buckets)
               if len(items) > 1)


def test_layout_digest_changes_with_shape_or_dtype():
    a = layout_of({"w": torch.zeros(2, 3)})
    assert layout_digest(a) == layout_digest(layout_of({"w": torch.ones(2, 3)}))
    assert layout_digest(a) != layout_digest(layout_of({"w": torch.zeros(3, 2)}))
    assert layout_digest(a) != layout_digest(layout_of({"w": torch.zeros(2, 3, dtype=torch.bfloat16)}))
