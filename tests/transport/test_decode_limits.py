"""Bounded decoding: every limit and schema rule raises DecodeError with its own reason."""

import msgpack
import numpy as np
import pytest

from flowrl.transport import Batch, DecodeError, DecodeLimits, decode, encode, wire


def desc(**changes):
    """A tensor descriptor (an array of `wire.TENSOR_FIELDS`) of 4 int64 in frame 1, with fields changed."""
    d = {"name": "x", "dtype": "int64", "shape": [4], "lib": "numpy", "at": 1, "offsets": None}
    d.update(changes)
    assert d.keys() == set(wire.TENSOR_FIELDS), "a typo in a field name"
    return [d[f] for f in wire.TENSOR_FIELDS]


def good_header(**changes):
    """A data header (an array of `wire.DATA_FIELDS`) of one tensor `x` in frame 1, with fields changed."""
    h = {"v": wire.SCHEMA_VERSION, "kind": "data", "batch_id": "b", "attempt": 0, "policy_version": 0, "meta": {},
         "tensors": [desc()], "route": None, "env": None, "shm": None}
    h.update(changes)
    assert h.keys() == set(wire.DATA_FIELDS), "a typo in a field name"
    return [h[f] for f in wire.DATA_FIELDS]


def as_map(header):
    """The same data header as the map that schema version 1 sent."""
    return dict(zip(wire.DATA_FIELDS, header))


def frames_of(header, *buffers):
    return [msgpack.packb(header, use_bin_type=True), *buffers]


X = np.arange(4, dtype=np.int64).tobytes()


def reason_of(frames, limits=DecodeLimits()):
    with pytest.raises(DecodeError) as info:
        decode(frames, limits)
    return info.value.reason


def control_reason(header):
    """The DecodeError reason of a control message `header` (a map), read as the receiver reads a hello."""
    with pytest.raises(DecodeError) as info:
        h = wire.unpack_header(msgpack.packb(header, use_bin_type=True), DecodeLimits())
        wire.Hello.from_header(h)
    return info.value.reason


HELLO = {"v": wire.SCHEMA_VERSION, "kind": "hello", "ch": "c", "state": "open", "need": 0, "idle": False,
         "ret_m": 0, "ret_b": 0}


def test_a_well_formed_message_decodes():
    assert decode(frames_of(good_header(), X)).tensors["x"].tolist() == [0, 1, 2, 3]
    assert wire.Hello.from_header(wire.unpack_header(msgpack.packb(HELLO), DecodeLimits())).ch == "c"


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
    assert reason_of(frames_of(good_header(tensors=[desc(dtype="object")]), X)) == "dtype"
    t = [desc(dtype="bfloat16", shape=[16])]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "bad_field"  # numpy has no bfloat16


def test_shape_times_itemsize_must_equal_the_frame_length():
    assert reason_of(frames_of(good_header(tensors=[desc(shape=[5])]), X)) == "size_mismatch"
    t = [desc(shape=[2 ** 62, 2 ** 62])]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "size_mismatch"  # no overflow
    t = [desc(shape=[1], lib="torch", at=b"abc")]
    assert reason_of(frames_of(good_header(tensors=t))) == "size_mismatch"


def test_shape_entries_and_rank_are_bounded():
    assert reason_of(frames_of(good_header(tensors=[desc(shape=[-4])]), X)) == "shape"
    assert reason_of(frames_of(good_header(tensors=[desc(shape=[1] * 33 + [4])]), X)) == "shape"


def test_map_keys_must_be_strings_and_known():
    """Maps (meta, control messages) take str keys, and a control message only its own; a data header
    and a tensor descriptor have no keys: they are arrays of exactly their fields."""
    raw = msgpack.packb({1: 2}, use_bin_type=True)
    assert reason_of([raw]) == "bad_msgpack"  # strict_map_key refuses the int key
    # ... at any depth, and an array as a key (which would decode to a tuple, whose hash is not randomised:
    # keys chosen to collide make building the map quadratic) before the map is built
    assert reason_of(frames_of(good_header(meta={"a": {3: 1}}), X)) == "bad_msgpack"
    tuple_key = b"\x81\x92\x01\x02\x03"  # {[1, 2]: 3}
    assert reason_of([tuple_key]) == "bad_msgpack"
    # bytes keys pass strict_map_key: in meta they are named; beside str ones in a control message they are
    # named too, not a TypeError from sorting them
    assert reason_of(frames_of(good_header(meta={b"raw": 1}), X)) == "bad_field"
    assert control_reason({**HELLO, b"raw": 1, "zz": 2}) == "unknown_key"
    assert control_reason({**HELLO, "extra": 1}) == "unknown_key"
    assert control_reason({k: v for k, v in HELLO.items() if k != "need"}) == "missing_key"
    # a data header was a map of these keys (schema version 1); as a map, with or without stray keys, it is
    # refused whole (it was unknown_key / missing_key)
    assert reason_of(frames_of(as_map(good_header()), X)) == "bad_header"
    assert reason_of(frames_of({**as_map(good_header()), b"raw": 1, "zz": 2}, X)) == "bad_header"
    # an extra field or a missing one (meta) is a data header of the wrong length (was unknown_key / missing_key)
    assert reason_of(frames_of(good_header() + [1], X)) == "bad_header"
    h = good_header()
    del h[wire.DATA_FIELDS.index("meta")]
    assert reason_of(frames_of(h, X)) == "bad_header"
    # ... and a tensor descriptor with an extra field or a missing one, or a map, is refused (was unknown_key)
    assert reason_of(frames_of(good_header(tensors=[desc() + [1]]), X)) == "bad_field"
    assert reason_of(frames_of(good_header(tensors=[desc()[:-1]]), X)) == "bad_field"
    as_dict = dict(zip(wire.TENSOR_FIELDS, desc()))
    assert reason_of(frames_of(good_header(tensors=[as_dict]), X)) == "bad_field"


def test_version_kind_and_msgpack_are_checked():
    assert reason_of(frames_of(good_header(v=99), X)) == "bad_version"
    assert reason_of(frames_of(good_header(v=1), X)) == "bad_version"  # the version whose data header was a map
    assert reason_of(frames_of(good_header(v=True), X)) == "bad_version"
    assert reason_of(frames_of(as_map(good_header(v=1)), X)) == "bad_version"
    assert reason_of(frames_of(good_header(kind="evil"), X)) == "bad_kind"
    assert reason_of(frames_of(good_header(kind="hello"), X)) == "bad_kind"  # an array is a data header only
    assert reason_of(frames_of(as_map(good_header(kind="evil")), X)) == "bad_kind"
    assert reason_of([b"\xc1garbage", X]) == "bad_msgpack"
    assert reason_of([msgpack.packb(7)]) == "bad_header"  # frame 0 is neither a map nor an array
    # an array of the right version and kind but of another length (an array used to be refused as not a map;
    # [1, 2] is now a data header of version 1: see above)
    assert reason_of([msgpack.packb([wire.SCHEMA_VERSION, "data"])]) == "bad_header"
    assert reason_of([msgpack.packb([])]) == "bad_version"
    assert reason_of([msgpack.packb([1, 2])]) == "bad_version"
    assert reason_of([msgpack.packb(HELLO)]) == "bad_kind"  # a control message is no data message
    assert reason_of([]) == "no_frames"


def test_frames_are_referenced_exactly_once():
    assert reason_of(frames_of(good_header(tensors=[desc(at=2)]), X)) == "frame_index"
    assert reason_of(frames_of(good_header(tensors=[desc(at=0)]), X)) == "frame_index"  # frame 0 is the header
    assert reason_of(frames_of(good_header(tensors=[desc(at=-1)]), X)) == "frame_index"
    t = [desc(), desc(name="y")]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "frame_index"
    assert reason_of(frames_of(good_header(), X, X)) == "stray_frame"


def test_where_a_tensor_is_must_be_bytes_or_an_int():
    """`at`: inline bytes or a frame index (an offset with shared memory); nothing else, not a bool either."""
    for at in (None, True, 1.0, "1", [1], {"frame": 1}):
        assert reason_of(frames_of(good_header(tensors=[desc(at=at)]), X)) == "bad_field", at
    # an int with a shared-memory block named but none given to the decoder: refused, not read from a frame
    assert reason_of(frames_of(good_header(shm=["blk", 3, 32]), X)) == "bad_field"


def test_meta_values_must_be_json_like():
    ext = msgpack.packb(good_header(meta={"t": msgpack.ExtType(5, b"x")}), use_bin_type=True)
    assert reason_of([ext, X]) == "bad_field"


def test_bool_bytes_other_than_0_and_1_are_refused():
    t = [desc(name="m", dtype="bool", shape=[2], at=b"\x01\x07")]
    assert reason_of(frames_of(good_header(tensors=t))) == "bad_value"


def test_leading_dimensions_must_agree():
    t = [desc(), desc(name="y", dtype="int8", shape=[3], at=b"abc")]
    assert reason_of(frames_of(good_header(tensors=t), X)) == "batch_invalid"


def test_ids_are_type_checked():
    assert reason_of(frames_of(good_header(batch_id=""), X)) == "bad_field"
    assert reason_of(frames_of(good_header(attempt=-1), X)) == "bad_field"
    assert reason_of(frames_of(good_header(policy_version="3"), X)) == "bad_field"
    assert reason_of(frames_of(good_header(attempt=True), X)) == "bad_field"


DEEP = b"\x91" * 1000 + b"\x01"  # msgpack: a list nested 1,000 deep (1 KB), whose repr raises RecursionError


def with_deep(header) -> bytes:
    """`header` packed with every "DEEP" string in it replaced by `DEEP`."""
    return msgpack.packb(header, use_bin_type=True).replace(msgpack.packb("DEEP"), DEEP)


@pytest.mark.parametrize("field", ["v", "kind", "batch_id", "attempt", "policy_version", "route", "shm", "tensors"])
def test_a_deeply_nested_value_in_a_data_header_is_refused_by_name(field):
    """An error message quotes the value it refuses: it must quote a short form, never build the
    whole repr of a hostile value (which raised RecursionError, an internal error, not a refusal)."""
    assert reason_of([with_deep(good_header(**{field: "DEEP"})), X])


@pytest.mark.parametrize("field", ["name", "dtype", "shape", "lib", "at", "offsets"])
def test_a_deeply_nested_value_in_a_tensor_descriptor_is_refused_by_name(field):
    value = ["DEEP"] if field == "shape" else "DEEP"
    assert reason_of([with_deep(good_header(tensors=[desc(**{field: value})])), X])


def test_a_deeply_nested_value_in_a_control_message_is_refused_by_name():
    assert control_reason_raw(with_deep({**HELLO, "state": "DEEP"})) == "bad_field"
    assert reason_of([with_deep({"v": "DEEP", "kind": "hello"})]) == "bad_version"
    assert reason_of([with_deep({"v": wire.SCHEMA_VERSION, "kind": "DEEP"})]) == "bad_kind"


def control_reason_raw(raw: bytes) -> str:
    with pytest.raises(DecodeError) as info:
        wire.Hello.from_header(wire.unpack_header(raw, DecodeLimits()))
    return info.value.reason
