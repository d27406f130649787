"""The per-message fast paths must decide exactly what the exhaustive paths decide.

`codec.decode_data` takes an inline numpy or torch tensor of a dtype numpy has (plain, of any number
of dimensions, or ragged with inline offsets) without the exhaustive per-field checks, and
`codec.prepare` takes native, C-contiguous numpy arrays and CPU torch tensors without converting
them. Here every mutation of a descriptor is decoded twice, with the fast path and with it switched
off, and both must agree: the same `DecodeError` reason, or the same tensors of the same kind. A
receiver also decodes a batch whose descriptors are the same as its last plain batch's by that
batch's plan (`codec.Plans`): a mutation after a planned batch must be decided as without the plan.
On a live link, a schema that changes from one message to the next is checked anew each time.
"""

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowrl.transport import Batch, DecodeError, Ragged, codec, decode, encode, wire
from tests.transport.helpers import wait_until
from tests.transport.test_hostile import Raw, bound, pack

pytestmark = pytest.mark.timeout(60)

OFFSETS = np.array([0, 2, 2, 5], dtype=np.int64)
TENSORS, ENV = wire.DATA_FIELDS.index("tensors"), wire.DATA_FIELDS.index("env")  # in a data header
SHAPE, SUB = wire.TENSOR_FIELDS.index("shape"), wire.TENSOR_FIELDS.index("offsets")  # in a tensor descriptor


def header_of(batch: Batch) -> list:
    frames = encode(batch)
    assert len(frames) == 1  # everything inline: the fast path's case
    return msgpack.unpackb(bytes(frames[0]))


def outcome(h: list, fast: bool, monkeypatch, plans: codec.Plans | None = None, frames: int = 1) -> tuple:
    """('error', reason) or ('ok', [(name, kind, dtype, values, offsets)]) of decoding header `h`
    (followed by `frames` - 1 frames no tensor refers to)."""
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(codec, "_FAST_SPECS", {})  # no (dtype, lib) qualifies: everything goes the long way
        try:
            b = decode([pack(h)] + [b"stray"] * (frames - 1), plans=plans)
        except DecodeError as e:
            return "error", e.reason
    out = []
    for name, t in b.tensors.items():
        if type(t) is Ragged:
            out.append((name, "ragged", *described(t.values), type(t.offsets).__name__, t.offsets.tolist()))
        else:
            out.append((name, *described(t), None, None))
    return "ok", (out, b.num_samples)


def described(t) -> tuple:
    """(kind, dtype, values) of a numpy array or torch tensor."""
    if isinstance(t, torch.Tensor):
        return "Tensor", str(t.dtype), list(t.shape), t.tolist()
    return type(t).__name__, t.dtype.str, list(t.shape), t.tolist()


odd_values = st.sampled_from([None, True, 1.5, -1, 0, 3, 2 ** 63, "", "x" * 300, "int64", "numpy", [], [1], {}, b"\x00"])
fields = st.sampled_from([*wire.TENSOR_FIELDS, "extra"])  # "extra": an item past the last field
mutations = st.lists(st.tuples(fields, st.one_of(
    odd_values,
    st.sampled_from(["int64", "float32", "bool", "bfloat16", "float16", "x", "torch ", "jax"]),
    st.lists(st.integers(-2, 8), max_size=3),
    st.binary(max_size=48),
    st.sampled_from(["delete"]),  # the item goes: a descriptor one field short
    # offsets: [shape, at], at inline bytes or a frame index, and arrays one item short or long
    st.tuples(st.lists(st.integers(-1, 6), max_size=2), st.one_of(st.binary(max_size=48), st.integers(0, 2))).map(list),
    st.lists(st.one_of(st.lists(st.integers(-1, 6), max_size=2), st.binary(max_size=48), st.none()), max_size=3),
)), min_size=0, max_size=3)


def mutate(desc: list, field: str, value) -> None:
    """Set (or with "delete", remove) the item of `desc` where `field` is (past the end: append it)."""
    i = len(desc) if field == "extra" else wire.TENSOR_FIELDS.index(field)
    if value == "delete":
        del desc[i:i + 1]
    elif i < len(desc):
        desc[i] = value
    else:
        desc.append(value)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ragged=st.booleans(), lib=st.sampled_from(["numpy", "torch"]), third=st.sampled_from(["2-d", "bool"]),
       which=st.integers(0, 2), changes=mutations,
       offsets_bytes=st.sampled_from([None, [0, 2, 2, 5], [1, 2, 2, 5], [0, 2, 2, 4], [0, 3, 2, 5], [0, 5], [0], []]))
def test_a_mutated_descriptor_is_decided_alike_with_and_without_the_fast_path(ragged, lib, third, which, changes,
                                                                           offsets_bytes, monkeypatch):
    as_lib = torch.from_numpy if lib == "torch" else (lambda a: a)
    values = np.arange(5, dtype=np.int64)
    t = Ragged(as_lib(values), as_lib(OFFSETS.copy())) if ragged else as_lib(values)
    other = (Ragged(as_lib(np.linspace(0, 1, 5).astype(np.float32)), t.offsets) if ragged
             else as_lib(np.ones(5, np.float32)))
    n = 3 if ragged else 5
    extra = np.arange(2 * n, dtype=np.int16).reshape(n, 2) if third == "2-d" else np.array([True, False, True, True, False][:n])
    h = header_of(Batch(tensors={"a": t, "b": other, "c": as_lib(extra)}, batch_id="b1"))
    desc = h[TENSORS][which]
    if offsets_bytes is not None and desc[SUB] is not None:
        desc[SUB] = [[len(offsets_bytes)], np.array(offsets_bytes, dtype=np.int64).tobytes()]
    for field, value in changes:
        mutate(desc, field, value)
    assert outcome(h, True, monkeypatch) == outcome(h, False, monkeypatch)


def planned(header: list) -> codec.Plans:
    """Plans taught by decoding `header` (a copy: the caller may change it after)."""
    plans = codec.Plans()
    decode([pack(header)], plans=plans)
    return plans


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lib=st.sampled_from(["numpy", "torch"]), which=st.integers(0, 2), changes=mutations,
       odd_shape=st.sampled_from([None, [5.0], [True], [5, 2.0], [5, True], [5.0, 2], [5, 2, 1]]))
def test_a_mutated_descriptor_after_a_planned_batch_is_decided_as_without_the_plan(lib, which, changes, odd_shape,
                                                                                monkeypatch):
    as_lib = torch.from_numpy if lib == "torch" else (lambda a: a)
    h = header_of(Batch(tensors={"a": as_lib(np.arange(5)), "b": as_lib(np.ones(5, np.float32)),
                                 "c": as_lib(np.arange(10, dtype=np.int16).reshape(5, 2))}, batch_id="b1"))
    plans = planned(h)
    assert plans.steps is not None and len(plans.steps) == 3
    desc = h[TENSORS][which]
    for field, value in changes:
        mutate(desc, field, value)
    if odd_shape is not None and len(desc) > SHAPE:
        desc[SHAPE] = odd_shape  # equal to the planned shape ([5], or [5, 2] for "c") where it is not the same
    assert outcome(h, True, monkeypatch, plans) == outcome(h, True, monkeypatch) == outcome(h, False, monkeypatch)


def test_a_planned_batch_is_made_by_its_plan_and_comes_out_right(monkeypatch):
    sent = {"tokens": np.arange(5), "logprobs": torch.ones(5), "pairs": np.arange(10, dtype=np.int16).reshape(5, 2)}
    plans = planned(header_of(Batch(tensors=sent, batch_id="first")))

    def slow(*args, **kwargs):
        raise AssertionError("a check the plan stands for was made")

    with monkeypatch.context() as m:
        m.setattr(codec, "_FAST_SPECS", {})
        m.setattr(codec, "_decode_tensor", slow)
        frames = encode(Batch(tensors=sent, batch_id="second", policy_version=3))
        a, b = decode(frames, plans=plans), decode(frames, plans=plans)
    assert a.batch_id == "second" and a.policy_version == 3 and a.num_samples == 5
    assert isinstance(a.tensors["logprobs"], torch.Tensor) and a.tensors["pairs"].shape == (5, 2)
    assert all(np.array_equal(np.asarray(a.tensors[k]), np.asarray(v)) for k, v in sent.items())
    a.tensors["tokens"][0] = 99  # writable, and its own memory
    assert b.tensors["tokens"][0] == 0
    # the same descriptors followed by a frame nothing refers to: refused, as without the plan
    h = header_of(Batch(tensors=sent, batch_id="third"))
    assert outcome(h, True, monkeypatch, plans, frames=2) == outcome(h, True, monkeypatch, frames=2) == ("error", "stray_frame")


def test_a_plan_serves_only_the_limits_its_batch_was_checked_against():
    h = header_of(Batch(tensors={"cube": np.zeros((2, 3, 4), np.float32)}, batch_id="b1"))
    plans = planned(h)
    assert plans.steps is not None
    with pytest.raises(DecodeError) as e:  # under tighter limits the same batch is checked again, and refused
        decode([pack(h)], wire.DecodeLimits(max_ndim=2), plans=plans)
    assert e.value.reason == "shape"


def test_bool_tensors_are_never_planned_so_their_values_are_checked_each_time(monkeypatch):
    h = header_of(Batch(tensors={"mask": np.array([True, False, True])}, batch_id="b1"))
    plans = planned(h)
    assert plans.steps is None
    h[TENSORS][0][wire.TENSOR_FIELDS.index("at")] = bytes([1, 2, 0])
    assert outcome(h, True, monkeypatch, plans) == ("error", "bad_value")


@pytest.mark.parametrize("offsets", [[1, 2, 2, 5], [0, 2, 2, 4], [0, 2, 2, 6], [0, 3, 2, 5], [0, 2, 6, 5], [0, 5, 5, 5, 5]])
def test_offsets_that_do_not_describe_the_values_are_refused_on_the_fast_path(offsets, monkeypatch):
    h = header_of(Batch(tensors={"r": Ragged(np.arange(5), OFFSETS)}, batch_id="b1"))
    h[TENSORS][0][SUB] = [[len(offsets)], np.array(offsets, np.int64).tobytes()]
    expected = ("error", "bad_offsets") if len(offsets) == 4 else ("ok", ([("r", "ragged", "ndarray", "<i8", [5], [0, 1, 2, 3, 4], "ndarray", offsets)], 4))
    assert outcome(h, True, monkeypatch) == outcome(h, False, monkeypatch) == expected


@pytest.mark.parametrize("shape, data", [
    ([3], OFFSETS.tobytes()), ([5], OFFSETS.tobytes()), ([4], OFFSETS.tobytes()[:-1]), ([1], b""),
], ids=["fewer", "more", "torn", "none"])
def test_offsets_whose_shape_does_not_match_their_bytes_are_refused_on_the_fast_path(shape, data, monkeypatch):
    h = header_of(Batch(tensors={"r": Ragged(np.arange(5), OFFSETS)}, batch_id="b1"))
    h[TENSORS][0][SUB] = [shape, data]
    assert outcome(h, True, monkeypatch) == outcome(h, False, monkeypatch) == ("error", "size_mismatch")


def test_the_fast_path_takes_the_common_tensors_and_they_come_out_right():
    tokens = Ragged(np.arange(5, dtype=np.int64), OFFSETS)
    b = decode(encode(Batch(tensors={"tokens": tokens, "logprobs": tokens.like(np.ones(5, np.float32)),
                                     "reward": np.array([1.0, 0.5, 0.0], np.float32)}, batch_id="x")))
    assert b.num_samples == 3 and b.tensors["reward"].tolist() == [1.0, 0.5, 0.0]
    assert b.tensors["tokens"].values.tolist() == [0, 1, 2, 3, 4] and b.tensors["tokens"].offsets.tolist() == [0, 2, 2, 5]
    assert b.tensors["logprobs"].offsets is b.tensors["tokens"].offsets  # aligned: one array, checked once
    b.tensors["reward"][0] = 7.0  # writable, like a received frame
    assert b.tensors["reward"].flags.writeable and b.tensors["tokens"].values.flags.writeable


def test_torch_tensors_take_the_fast_paths_both_ways_and_come_out_as_writable_torch_tensors(monkeypatch):
    tokens = Ragged(torch.arange(5), torch.from_numpy(OFFSETS.copy()))
    sent = {"tokens": tokens, "mask": tokens.like(torch.tensor([True, False, True, True, False])),
            "targets": torch.arange(6, dtype=torch.int32).reshape(3, 2), "reward": torch.tensor([1.0, 0.5, 0.0])}

    def slow(*args, **kwargs):
        raise AssertionError("the exhaustive path was taken")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "detach", slow)  # prepare's conversion of a tensor it cannot take as it is
        m.setattr(codec, "_decode_tensor", slow)
        b = decode(encode(Batch(tensors=sent, batch_id="x")))
    for name, t in sent.items():
        got = b.tensors[name]
        if type(t) is Ragged:
            assert torch.equal(got.values, t.values) and torch.equal(got.offsets, t.offsets)
        else:
            assert isinstance(got, torch.Tensor) and got.dtype == t.dtype and torch.equal(got, t)
    assert b.tensors["mask"].offsets is b.tensors["tokens"].offsets  # aligned: one tensor, checked once
    b.tensors["targets"][0, 0] = 9  # writable, like a received frame
    assert b.num_samples == 3 and b.tensors["targets"].shape == (3, 2)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(4.0, requires_grad=True),           # needs grad: sent as its values
    lambda: torch.arange(4.0)._neg_view(),                     # a negative view: resolved
    lambda: torch.arange(8.0)[::2],                            # not contiguous
    lambda: torch.arange(4.0).to(torch.bfloat16),             # a dtype numpy has not
], ids=["grad", "neg-view", "strided", "bfloat16"])
def test_torch_tensors_prepare_cannot_take_as_they_are_arrive_as_their_values(make):
    t = make()
    got = decode(encode(Batch(tensors={"t": t}, batch_id="x"))).tensors["t"]
    assert got.dtype == t.dtype and torch.equal(got, t.detach().resolve_neg())


def test_two_decodes_of_the_same_bytes_share_no_memory():
    frames = encode(Batch(tensors={"x": np.arange(3), "r": Ragged(np.arange(5), OFFSETS)}, batch_id="x"))
    a, b = decode(frames), decode(frames)
    a.tensors["x"][0] = 99
    a.tensors["r"].offsets[1] = 1
    assert b.tensors["x"][0] == 0 and b.tensors["r"].offsets[1] == 2


@pytest.mark.parametrize("make", [
    lambda: np.arange(6, dtype=">i4"),                       # not the host's byte order
    lambda: np.arange(12, dtype=np.int64)[::2],              # not contiguous
    lambda: np.arange(6, dtype=np.int64).reshape(6, 1),      # 2-d
    lambda: np.array([True, False] * 3),                     # bool: its bytes are checked
    lambda: Ragged(np.arange(5), np.array([0, 1, 1, 3, 5, 5, 5], dtype="q")),  # offsets as C long long
], ids=["big-endian", "strided", "2-d", "bool", "longlong-offsets"])
def test_tensors_outside_the_fast_paths_still_round_trip(make):
    t = make()
    got = decode(encode(Batch(tensors={"t": t}, batch_id="x"))).tensors["t"]
    if type(t) is Ragged:
        assert got.values.tolist() == t.values.tolist() and got.offsets.tolist() == t.offsets.tolist()
    else:
        assert got.tolist() == t.tolist() and got.dtype == t.dtype.newbyteorder("=")


@pytest.mark.anyio
async def test_a_schema_that_changes_between_messages_on_one_link_is_checked_each_time(tmp_path):
    def frames(seq: int, inc: str, tensors: dict, lie=None) -> list[bytes]:
        h = header_of(Batch(tensors=tensors, batch_id=f"m{seq}"))
        h[ENV] = [inc, seq]
        if lie:
            lie(h)
        return [pack(h)]

    def lying_shape(h):
        h[TENSORS][0][SHAPE] = [3]  # the data holds 4 values

    def torn_bytes(h):
        h[TENSORS][0][wire.TENSOR_FIELDS.index("at")] = h[TENSORS][0][wire.TENSOR_FIELDS.index("at")][:-1]

    def bad_offsets(h):
        h[TENSORS][0][SUB][1] = np.array([0, 3, 2, 5], np.int64).tobytes()  # offsets: [shape, at]

    async with bound(tmp_path) as (rx, address):
        raw = Raw(address)
        inc = (await raw.join()).inc
        raw.send(*frames(1, inc, {"x": np.arange(4)}))
        raw.send(*frames(2, inc, {"y": np.ones(3, np.float32), "r": Ragged(np.arange(5), OFFSETS)}))
        raw.send(*frames(3, inc, {"x": np.arange(4)}, lie=lying_shape))
        raw.send(*frames(4, inc, {"r": Ragged(np.arange(5), OFFSETS)}, lie=bad_offsets))
        raw.send(*frames(5, inc, {"x": np.arange(4, dtype=np.int16)}))
        raw.send(*frames(6, inc, {"x": np.arange(4, dtype=np.int16)}, lie=torn_bytes))  # same descriptors as m5's
        raw.send(*frames(7, inc, {"x": np.arange(4, dtype=np.int16)}))
        got = [await rx.recv() for _ in range(4)]
        await wait_until(lambda: rx.statistics().rejected == 3)
        assert [b.batch_id for b in got] == ["m1", "m2", "m5", "m7"]
        assert got[2].tensors["x"].dtype == np.int16 and got[1].tensors["r"].offsets.tolist() == [0, 2, 2, 5]
        assert got[3].tensors["x"].tolist() == [0, 1, 2, 3]
        assert rx.statistics().rejected_by_reason == {"size_mismatch": 2, "bad_offsets": 1}
        raw.close()
