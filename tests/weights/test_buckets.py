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


def test_a_dict_packs_in_fused_copies_and_any_other_mapping_one_tensor_at_a_time_in_plan_order():
    from collections.abc import Mapping

    src = {k: v.requires_grad_(v.is_floating_point()) for k, v in model_like().items()}  # live parameters
    plan = BucketPlan(serving_layout(layout_of(src), "bfloat16"), bucket_bytes=20_000)

    class OneByOne(Mapping):  # a sharded trainer's FullState: each read gathers one tensor
        def __init__(self):
            self.read = []

        def __getitem__(self, name):
            self.read.append(name)
            return src[name]

        def __iter__(self):
            return iter(src)

        def __len__(self):
            return len(src)

    fused, one_by_one = plan.pack(src), plan.pack(mapping := OneByOne(), out=plan.allocate())
    assert all(torch.equal(a, b) for a, b in zip(fused, one_by_one)) and not any(b.requires_grad for b in fused)
    assert mapping.read == [name for _, entries, _ in plan.buckets for name, *_ in entries]
    again = {k: v.detach() * 2 for k, v in src.items()}
    plan.pack(again, out=fused)  # the same buffers again: their cached views, the new values
    views = plan.views(fused)
    assert torch.equal(views["l0.w"], again["l0.w"].bfloat16()) and torch.equal(views["step"], again["step"])
    live = {k: torch.zeros_like(v, requires_grad=False) for k, v in src.items()}
    for i in range(len(plan)):
        plan.unpack(i, fused, live)
    assert torch.equal(live["emb"], again["emb"].bfloat16().float())


def test_the_version_rides_behind_the_last_buckets_tensors_whatever_its_dtype():
    """The label travels in the same broadcast as the weights it labels: an int64 at an 8-byte
    boundary behind the last bucket's tensors, never over one of them (any itemsize, odd counts)."""
    from flowrl.weights.handoff import plan_offsets

    cases = {"bfloat16 odd": {"a": torch.randn(3).bfloat16()}, "uint8 odd": {"a": torch.arange(5, dtype=torch.uint8)},
             "float32": {"a": torch.randn(7), "b": torch.randn(2, 3)}, "mixed": model_like(), "none": {}}
    for what, src in cases.items():
        plan = BucketPlan(layout_of(src), bucket_bytes=20_000)
        buckets = plan.pack(src) if src else plan.allocate()
        slot = plan.version_slot(buckets)
        slot.fill_(-(2**40) - 3)  # every byte of it
        assert int(plan.version_slot(buckets)[0]) == -(2**40) - 3, what
        assert slot.dtype == torch.int64 and slot.data_ptr() % 8 == 0, what
        for name, tensor in src.items():  # the tensors are untouched
            assert torch.equal(plan.views(buckets)[name], tensor.reshape(plan.views(buckets)[name].shape)), (what, name)
        assert plan.nbytes(buckets) == sum(t.numel() * t.element_size() for t in src.values()), what
        received = plan.allocate()
        for s, r in zip(buckets, received):
            r.copy_(s)  # what the broadcast does: the version arrives with the last bucket
        assert int(plan.version_slot(received)[0]) == -(2**40) - 3, what
        offsets, total = plan_offsets(plan)  # a handoff's region holds the slot too
        assert offsets[-1][1] == buckets[-1].numel() * buckets[-1].element_size() and offsets[-1][0] + offsets[-1][1] <= total
