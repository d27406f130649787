"""Fuzzing: random and mutated bytes against the decoder and against a live channel socket.

The decoder may accept a mutated message (flipping a data byte keeps it valid) but must never raise
anything but DecodeError, crash or hang. On a live channel, junk from a foreign process (a plain
pyzmq DEALER) is rejected and counted one for one while good traffic on the channel is untouched.
"""

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowrl.transport import Batch, DecodeError, DecodeLimits, Receiver, Sender, decode, encode
from tests.transport.helpers import fast_config, spawn_peer, wait_until

LIMITS = DecodeLimits(max_header_bytes=1 << 16, max_frames=16, max_message_bytes=1 << 20)

scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats() | st.text(max_size=8)
           | st.binary(max_size=8))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)
tensor_descs = st.one_of(  # [name, dtype, shape, lib, at, offsets] (wire.TENSOR_FIELDS), of any length
    st.tuples(st.text(max_size=4), st.sampled_from(["int64", "bool", "float16", "bfloat16", "x"]),
              st.lists(st.integers(-2, 9), max_size=3), st.sampled_from(["numpy", "torch", "jax"]),
              st.integers(-1, 3) | st.binary(max_size=40) | json_values,
              st.none() | st.tuples(st.lists(st.integers(-1, 9), max_size=2),
                                    st.integers(-1, 3) | st.binary(max_size=40)).map(list) | json_values).map(list),
    st.lists(json_values, max_size=7))
# wire.DATA_FIELDS: [v, kind, batch_id, attempt, policy_version, meta, tensors, route, env, shm]
data_headers = st.tuples(
    st.sampled_from([2, 2, 1, "2", True]), st.sampled_from(["data", "data", "hello", "?"]), json_values, json_values,
    json_values, json_values, st.lists(tensor_descs, max_size=3) | json_values, st.none() | json_values,
    st.none() | json_values, st.none() | json_values).map(list)
headers = st.one_of(  # data headers, of the right length and not; control messages and maps of old
    data_headers, data_headers.map(lambda h: h[:-1]), data_headers.map(lambda h: [*h, 0]),
    st.fixed_dictionaries(
        {"v": st.sampled_from([1, 2, 2, "1"]), "kind": st.sampled_from(["data", "hello", "status", "bundle", "?"])},
        optional={"batch_id": json_values, "meta": json_values, "tensors": st.lists(tensor_descs, max_size=3),
                  "env": json_values, "parts": json_values, "extra": json_values}))


def valid_frames(i: int) -> list[bytes]:
    b = Batch(tensors={"x": np.arange(i % 5 + 1, dtype=np.int64), "big": np.ones((i % 5 + 1, 1100), np.float64)},
              meta={"i": i, "l": [1, {"k": "v"}]}, batch_id=f"b{i}")
    return [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in encode(b)]


@st.composite
def mutated(draw) -> list[bytes]:
    frames = valid_frames(draw(st.integers(0, 20)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "extend", "drop", "dup", "swap", "header"]))
        i = draw(st.integers(0, len(frames) - 1))
        f = bytearray(frames[i])
        if op == "flip" and f:
            f[draw(st.integers(0, len(f) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del f[draw(st.integers(0, len(f))):]
        elif op == "extend":
            f += draw(st.binary(min_size=1, max_size=16))
        elif op == "drop" and len(frames) > 1:
            frames.pop(i)
            continue
        elif op == "dup":
            frames.append(bytes(f))
        elif op == "swap":
            frames.reverse()
        elif op == "header":
            f = bytearray(msgpack.packb(draw(headers), use_bin_type=True))
            i = 0
        frames[i] = bytes(f)
    return frames


junk = st.one_of(st.lists(st.binary(max_size=300), min_size=1, max_size=5), mutated(),
                 headers.map(lambda h: [msgpack.packb(h, use_bin_type=True)]))


@settings(max_examples=200, deadline=None)
@given(junk)
def test_the_decoder_only_ever_raises_decode_error(frames):
    try:
        batch = decode(frames, LIMITS)
    except DecodeError:
        return
    assert isinstance(batch, Batch) and batch.num_samples >= 0  # an accepted mutation is a valid batch


@pytest.mark.anyio
@pytest.mark.timeout(60)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(junk.filter(lambda m: sum(map(len, m)) < 60_000), min_size=1, max_size=6))
async def test_junk_from_a_foreign_process_is_rejected_and_counted_while_good_traffic_flows(live, messages):
    rx, tx, intruder, state = live
    for frames in messages:
        await intruder.tell(frames=[f.hex() for f in frames])
        await intruder.next_event("sent")
    state["junk"] += len(messages)
    state["good"] += 1
    await tx.send(Batch(tensors={"x": np.full(3, state["good"], dtype=np.int64)}, batch_id=f"good{state['good']}"))
    good = await rx.recv()
    assert good.batch_id == f"good{state['good']}" and good.tensors["x"].tolist() == [state["good"]] * 3
    await rx.ack(good)
    await wait_until(lambda: rx.statistics().rejected == state["junk"])
    assert rx.statistics().received == state["good"]


@pytest.fixture
async def live(tmp_path):
    cfg = fast_config(transport="ipc", max_message_bytes=1 << 20, max_frames=16, max_header_bytes=1 << 16)
    async with Receiver(cfg, name="fuzz") as rx, Sender(cfg, name="fuzz") as tx:
        address = await rx.bind(f"ipc://{tmp_path}/fuzz")
        await tx.connect(address)
        async with spawn_peer("junk", address) as intruder:
            await intruder.next_event("ready")
            yield rx, tx, intruder, {"junk": 0, "good": 0}
            assert tx.statistics().in_flight == 0 or await _settled(tx)


async def _settled(tx) -> bool:
    await wait_until(lambda: tx.statistics().in_flight == 0)
    return True
