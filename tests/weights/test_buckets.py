"""Bucket plans and layouts: nothing lost, casts only floats, mismatches named by tensor."""

import torch

from flowrl.weights import BucketPlan, layout_digest, layout_mismatch, layout_of, serving_layout


def model_like():
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(512, 1024, generator=g),  # 2 MiB: a bucket of its own
        "l0.w": torch.randn(64, 64, generator=g),
        "l0.b": torch.randn(64, generator=g),
        "l0.h": torch.randn(64, generator=g).half(),
        "l1.w": torch.randn(64, 64, generator=g),
        "step": torch.tensor(3, dtype=torch.int64),
    }


def test_pack_then_unpack_reproduces_every_tensor_bitwise():
    src = model_like()
    plan = BucketPlan(layout_of(src), bucket_bytes=20_000)
    sent = plan.pack(src)
    received = plan.allocate()
    for s, r in zip(sent, received):
        r.copy_(s)  # what the broadcast does
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    for i in range(len(plan)):
        plan.unpack(i, received, dst)
    for k in src:
        assert torch.equal(src[k], dst[k]), k
    assert sorted(n for n, _ in plan.iter_views(received)) == sorted(src)


def test_buckets_hold_one_dtype_each_within_the_size_and_never_alias_the_model():
    live = model_like()
    plan = BucketPlan(layout_of(live), bucket_bytes=20_000)
    buckets = plan.allocate()
    assert all(b.data_ptr() != t.data_ptr() for b in buckets for t in live.values())
    dtypes = [d for d, _, _ in plan.buckets]
    assert "float16" in dtypes and "int64" in dtypes
    assert all(n * buckets[i].element_size() <= 20_000 for i, (_, items, n) in enumerate(plan.buckets)
               if len(items) > 1)


def test_serving_dtype_casts_floats_only_and_packs_the_cast_values():
    src = model_like()
    layout = serving_layout(layout_of(src), "bfloat16")
    assert {d for _, _, d in layout} == {"bfloat16", "int64"}
    plan = BucketPlan(layout, bucket_bytes=1 << 20)
    views = plan.views(plan.pack(src))
    assert torch.equal(views["l0.w"], src["l0.w"].bfloat16()) and torch.equal(views["step"], src["step"])


def test_layout_digest_changes_with_shape_or_dtype():
    a = layout_of({"w": torch.zeros(2, 3)})
    assert layout_digest(a) == layout_digest(layout_of({"w": torch.ones(2, 3)}))
    assert layout_digest(a) != layout_digest(layout_of({"w": torch.zeros(3, 2)}))
    assert layout_digest(a) != layout_digest(layout_of({"w": torch.zeros(2, 3, dtype=torch.bfloat16)}))


def test_a_layout_mismatch_names_the_tensor_and_both_sides():
    pub = layout_of({"a": torch.zeros(2), "w": torch.zeros(2, 3)})
    assert layout_mismatch(pub, pub) is None
    dtype = layout_mismatch(pub, layout_of({"a": torch.zeros(2), "w": torch.zeros(2, 3, dtype=torch.bfloat16)}))
    assert "'w' is float32[2, 3] on the publisher but bfloat16[2, 3] on the subscriber" in dtype
    assert "serving_dtype='bfloat16'" in dtype
    assert "'w' is published" in layout_mismatch(pub, layout_of({"a": torch.zeros(2)}))
    assert "'x'" in layout_mismatch(pub, layout_of({"a": torch.zeros(2), "w": torch.zeros(2, 3), "x": torch.zeros(1)}))
