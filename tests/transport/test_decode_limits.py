"""Bounded decoding: every limit and schema rule raises DecodeError with its own reason."""

import msgpack
import numpy as np
import pytest

from flowrl.transport import Batch, DecodeError, DecodeLimits, decode, encode


def good_header(**changes):
    h = {"v": 1, "kind": "data", "batch_id": "b", "attempt": 0, "policy_version": 0, "meta": {},
         "tensors": [{"name": "x", "dtype": "int64", "shape": [4], "lib": "numpy", "frame": 1}]}
    h.update(changes)
    return h


def frames_of(header, *buffers):
    return [msgpack.packb(header, use_bin_type=True), *buffers]


X = np.arange(4, dtype=np.int64).tobytes()


def reason_of(frames, limits=DecodeLimits()):
    with pytest.raises(DecodeError) as info:
        decode(frames, limits)
    return info.value.reason


def test_a_well_formed_message_decodes():
    assert decode(frames_of(good_header(), X)).tensors["x"].tolist() == [0, 1, 2, 3]


def test_header_size_limit():
    frames = encode(Batch(tensors={}, meta={"pad": "x" * 2000}))
    assert reason_of(frames, DecodeLimits(max_header_bytes=1000)) == "header_too_large"


def test_frame_count_limit():
    assert reason_of(frames_of(good_header(), X, X, X), DecodeLimits(max_frames=2)) == "too_many_frames"


def test_total_message_size_limit():
    assert reason_of(frames_of(good_header(), X), DecodeLimits(max_message_bytes=64)) == "message_too_large"


def test_nesting_depth_limit():
    deep = {}
    node = deep
    for _ in range(40):
        node["d"] = {}
        node = node["d"]
    assert reason_of(frames_of(good_header(meta=deep), X)) == "depth"
    assert reason_of(frames_of(good_header(meta={"l": [[[[1]]]]}), X), DecodeLimits(max_depth=3)) == "depth"


def test_dtype_allow_list():
    t = [{"name": "x", "dtype": "object", "shape": [4], "lib": "numpy", "frame": 1}]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "dtype"
    t = [{"name": "x", "dtype": "bfloat16", "shape": [16], "lib": "numpy", "frame": 1}]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "bad_field"  # numpy has no bfloat16


def test_shape_times_itemsize_must_equal_the_frame_length():
    t = [{"name": "x", "dtype": "int64", "shape": [5], "lib": "numpy", "frame": 1}]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "size_mismatch"
    t = [{"name": "x", "dtype": "int64", "shape": [2 ** 62, 2 ** 62], "lib": "numpy", "frame": 1}]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "size_mismatch"  # no overflow
    t = [{"name": "x", "dtype": "int64", "shape": [1], "lib": "torch", "data": b"abc"}]
    assert reason_of(frames_of(good_header(tensors=t))) == "size_mismatch"


def test_shape_entries_and_rank_are_bounded():
    t = [{"name": "x", "dtype": "int64", "shape": [-4], "lib": "numpy", "frame": 1}]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "shape"
    t = [{"name": "x", "dtype": "int64", "shape": [1] * 33 + [4], "lib": "numpy", "frame": 1}]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "shape"


def test_map_keys_must_be_strings_and_known():
    raw = msgpack.packb({1: 2}, use_bin_type=True)
    assert reason_of([raw]) == "bad_msgpack"  # strict_map_key refuses the int key
    # ... at any depth, and an array as a key (which would decode to a tuple, whose hash is not randomised:
    # keys chosen to collide make building the map quadratic) before the map is built
    assert reason_of(frames_of(good_header(meta={"a": {3: 1}}), X)) == "bad_msgpack"
    tuple_key = b"\x81\x92\x01\x02\x03"  # {[1, 2]: 3}
    assert reason_of([tuple_key]) == "bad_msgpack"
    # bytes keys pass strict_map_key: beside str ones they are named, not a TypeError from sorting them
    assert reason_of(frames_of({**good_header(), b"raw": 1, "zz": 2}, X)) == "unknown_key"
    assert reason_of(frames_of(good_header(extra=1), X)) == "unknown_key"
    h = good_header()
    del h["meta"]
    assert reason_of(frames_of(h, X)) == "missing_key"
    t = [{"name": "x", "dtype": "int64", "shape": [4], "lib": "numpy", "frame": 1, "more": 1}]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "unknown_key"


def test_version_kind_and_msgpack_are_checked():
    assert reason_of(frames_of(good_header(v=99), X)) == "bad_version"
    assert reason_of(frames_of(good_header(kind="evil"), X)) == "bad_kind"
    assert reason_of([b"\xc1garbage", X]) == "bad_msgpack"
    assert reason_of([msgpack.packb([1, 2])]) == "bad_header"
    assert reason_of([]) == "no_frames"


def test_frames_are_referenced_exactly_once():
    t = [{"name": "x", "dtype": "int64", "shape": [4], "lib": "numpy", "frame": 2}]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "frame_index"
    t = [{"name": "x", "dtype": "int64", "shape": [4], "lib": "numpy", "frame": 1},
         {"name": "y", "dtype": "int64", "shape": [4], "lib": "numpy", "frame": 1}]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "frame_index"
    assert reason_of(frames_of(good_header(), X, X)) == "stray_frame"


def test_meta_values_must_be_json_like():
    ext = msgpack.packb(good_header(meta={"t": msgpack.ExtType(5, b"x")}), use_bin_type=True)
    assert reason_of([ext, X]) == "bad_field"


def test_bool_bytes_other_than_0_and_1_are_refused():
    t = [{"name": "m", "dtype": "bool", "shape": [2], "lib": "numpy", "data": b"\x01\x07"}]
    assert reason_of(frames_of(good_header(tensors=t))) == "bad_value"


def test_leading_dimensions_must_agree():
    t = [{"name": "x", "dtype": "int64", "shape": [4], "lib": "numpy", "frame": 1},
         {"name": "y", "dtype": "int8", "shape": [3], "lib": "numpy", "data": b"abc"}]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "batch_invalid"


def test_ids_are_type_checked():
    assert reason_of(frames_of(good_header(batch_id=""), X)) == "bad_field"
    assert reason_of(frames_of(good_header(attempt=-1), X)) == "bad_field"
    assert reason_of(frames_of(good_header(policy_version="3"), X)) == "bad_field"
    assert reason_of(frames_of(good_header(attempt=True), X)) == "bad_field"
