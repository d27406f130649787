"""Codec round trips: every dtype, numpy and torch, odd shapes and layouts, inline and framed."""

import datetime
import enum

import numpy as np
import pytest
import torch

from flowrl.transport import DTYPES, Batch, decode, encode
from flowrl.transport.codec import INLINE_MAX_BYTES

NUMPY_DTYPES = [d for d in DTYPES if d != "bfloat16"]


def roundtrip(batch, **kw):
    frames = encode(batch, **kw)
    # what a receiver gets: separate buffers, not the sender's objects
    return decode([bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in frames])


def sample(dtype: str, shape, lib: str):
    rng = np.random.default_rng(0)
    if dtype == "bool":
        a = rng.integers(0, 2, size=shape).astype(bool)
    elif dtype.startswith(("int", "uint")):
        a = rng.integers(0, 100, size=shape).astype(dtype)
    else:
        a = rng.standard_normal(size=shape).astype("float32" if dtype == "bfloat16" else dtype)
    if lib == "numpy":
        return a
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(getattr(torch, dtype))


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 0), (0,), (), (2, 3, 4, 5)])
def test_numpy_tensors_of_every_dtype_and_shape_round_trip(dtype, shape):
    b = Batch(tensors={"x": sample(dtype, shape, "numpy")}, meta={"k": [1, "a", None]}, batch_id="b",
              attempt=1, policy_version=4)
    out = roundtrip(b)
    assert same(b.tensors["x"], out.tensors["x"])
    assert (out.batch_id, out.attempt, out.policy_version, out.meta) == ("b", 1, 4, {"k": [1, "a", None]})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 0), ()])
def test_torch_tensors_of_every_dtype_including_bfloat16_round_trip(dtype, shape):
    b = Batch(tensors={"x": sample(dtype, shape, "torch")})
    assert same(b.tensors["x"], roundtrip(b).tensors["x"])


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_non_contiguous_tensors_arrive_as_their_values(lib):
    base = sample("float32", (6, 8), lib)
    views = {"t": base.T, "stride": base[::2], "col": base[:, 3]}
    b = Batch(tensors={"t": views["t"]})
    out = roundtrip(b).tensors["t"]
    assert np.array_equal(np.asarray(out), np.asarray(views["t"]))
    b = Batch(tensors={"s": views["stride"][:, ::3]})
    assert np.array_equal(np.asarray(roundtrip(b).tensors["s"]), np.asarray(views["stride"][:, ::3]))


def test_big_endian_numpy_arrives_with_the_same_values():
    a = np.arange(10, dtype=">i4")
    out = roundtrip(Batch(tensors={"a": a})).tensors["a"]
    assert out.tolist() == a.tolist() and out.dtype == np.dtype("<i4")


def test_small_tensors_travel_inline_and_large_ones_in_their_own_frames():
    small = np.zeros((1, INLINE_MAX_BYTES // 8), dtype=np.int64)
    large = np.zeros((1, INLINE_MAX_BYTES // 8 + 1), dtype=np.int64)
    assert len(encode(Batch(tensors={"s": small}))) == 1
    frames = encode(Batch(tensors={"s": small, "l": large}))
    assert len(frames) == 2 and frames[1] is large  # zero-copy: the array itself is the frame
    assert len(encode(Batch(tensors={"s": small}), inline_max=0)) == 2


def test_decoded_tensors_are_writable_views_of_the_received_frames():
    frames = encode(Batch(tensors={"l": np.arange(100_000, dtype=np.int64).reshape(1, -1), "s": np.arange(3)[None]}))
    received = [bytearray(memoryview(f).cast("B")) for f in frames]
    out = decode(received)
    out.tensors["l"][0, 0] = 7  # shares memory with the frame: no copy on receipt
    assert received[1][:8] == (7).to_bytes(8, "little")
    out.tensors["s"][0, 0] = 5  # inline tensors are writable too


def test_meta_that_is_not_json_like_is_refused_when_encoding():
    with pytest.raises(TypeError, match="JSON-like"):
        encode(Batch(tensors={}, meta={"f": object()}))
    # what the consumer would refuse is refused at the sender, where the code that put it there is
    cyclic: list = []
    cyclic.append(cyclic)
    for bad in ({"s": {1, 2}}, {"b": b"raw"}, {"k": {3: "int key"}}, {"d": [{"t": datetime.date(2026, 1, 1)}]},
                {"c": cyclic}):
        with pytest.raises(TypeError, match="JSON-like"):
            encode(Batch(tensors={}, meta=bad))


def test_meta_values_of_subclasses_travel_as_their_plain_values():
    class Kind(enum.IntEnum):
        GOOD = 2

    meta = {"reward": np.float64(0.5), "kind": Kind.GOOD, "pair": (1, "a"), "nested": {"x": [np.float64(1.0)]}}
    out = decode(encode(Batch(tensors={}, meta=meta))).meta
    assert out == {"reward": 0.5, "kind": 2, "pair": [1, "a"], "nested": {"x": [1.0]}}
    assert type(out["reward"]) is float and type(out["kind"]) is int


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tensors_are_copied_to_the_host_and_arrive_as_cpu_tensors():
    t = torch.arange(10, device="cuda")
    out = roundtrip(Batch(tensors={"t": t})).tensors["t"]
    assert out.device.type == "cpu" and torch.equal(out, t.cpu())
