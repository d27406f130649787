"""Ragged tensors: one sequence of its own length per sample, in a Batch and on a channel.

Covered: construction and its checks, select / split / concat keeping offsets and prompt groups,
token-balanced splits, padded <-> ragged, the codec (inline, frames, torch and numpy, trailing
dimensions), garbled offsets rejected by the decoder with a named error, and a round trip through a
real ipc channel and through shared memory (zero-copy: the received values view the block).
"""

from __future__ import annotations

import gc

import msgpack
import numpy as np
import pytest
import torch

from flowrl.transport import Batch, codec, wire
from flowrl.transport.errors import DecodeError
from flowrl.transport.ragged import Ragged, RaggedError

TENSORS = wire.DATA_FIELDS.index("tensors")  # in a data header
NAME, AT, SUB = (wire.TENSOR_FIELDS.index(f) for f in ("name", "at", "offsets"))  # in a tensor descriptor


def seqs(lengths, seed=0, dtype=np.int64):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, size=n).astype(dtype) for n in lengths]


def same(a: Ragged, b: Ragged) -> None:
    assert a.is_torch == b.is_torch
    assert np.array_equal(np.asarray(a.offsets), np.asarray(b.offsets))
    av = a.values.float() if a.is_torch and a.values.dtype == torch.bfloat16 else a.values
    bv = b.values.float() if b.is_torch and b.values.dtype == torch.bfloat16 else b.values
    assert np.array_equal(np.asarray(av), np.asarray(bv))


# ------------------------------------------------------------------------------------------ the type
def test_ragged_holds_each_sample_with_its_own_length_and_pads_only_on_request():
    r = Ragged.from_sequences([[5, 6, 7], [8], []], dtype="int64")
    assert r.num_samples == 3 and r.lengths.tolist() == [3, 1, 0] and r.total == 4
    assert r[0].tolist() == [5, 6, 7] and r[2].tolist() == []
    assert r.to_padded(pad=-1).tolist() == [[5, 6, 7], [8, -1, -1], [-1, -1, -1]]
    assert r.to_padded(pad=0, side="left").tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert r.mask().tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    same(Ragged.from_padded(r.to_padded(9, side="left"), r.lengths, side="left"), r)
    same(Ragged.from_padded(r.to_padded(9), r.lengths), r)
    assert r.sample_ids().tolist() == [0, 0, 0, 1]
    lp = r.like(torch.arange(4.0))
    assert lp.aligned(r) and lp[0].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(RaggedError, match="one per token"):
        r.like(torch.zeros(5))


@pytest.mark.parametrize("values, offsets, match", [
    (np.arange(5), np.array([0, 2, 4]), "end at the 5 values"),
    (np.arange(5), np.array([1, 2, 5]), "start at 0"),
    (np.arange(5), np.array([0, 3, 2, 5]), "must not decrease"),
    (np.arange(5), np.array([0, 5], dtype=np.int32), "int64"),
    (np.arange(5), torch.tensor([0, 5]), "same kind"),
])
def test_offsets_that_do_not_describe_the_values_are_refused_with_the_reason(values, offsets, match):
    with pytest.raises(RaggedError, match=match):
        Ragged(values, offsets)


def test_a_batch_refuses_ragged_tensors_of_another_sample_count():
    with pytest.raises(ValueError, match="leading dimension"):
        Batch(tensors={"tokens": Ragged.from_sequences(seqs([3, 4])), "scores": torch.zeros(3)})
    bad = Ragged(np.arange(4), np.array([0, 4]), check=True)
    object.__setattr__(bad, "offsets", np.array([0, 9]))  # corrupted after construction
    with pytest.raises(ValueError, match="ragged tensor 'x'"):
        Batch(tensors={"x": bad})


@pytest.mark.parametrize("lib", ["torch", "numpy"])
def test_select_split_concat_keep_offsets_right_and_prompt_groups_whole(lib):
    lengths = [3, 1, 4, 1, 5, 9, 2, 6]
    tokens = Ragged.from_sequences(seqs(lengths), lib=lib)
    b = Batch(tensors={"tokens": tokens, "logprobs": tokens.like(tokens.values * 0.5),
                       "scores": np.arange(8, dtype=np.float32)}, meta={"samples_per_prompt": 2})
    picked = b.select([5, 0, 7])
    assert picked.tensors["tokens"].lengths.tolist() == [9, 3, 6]
    assert picked.tensors["tokens"][0].tolist() == tokens[5].tolist()
    assert picked.tensors["logprobs"].aligned(picked.tensors["tokens"])
    parts = b.split(3)  # 4 groups of 2 over 3 parts: 2 + 1 + 1 groups, never a group cut
    assert [p.num_samples for p in parts] == [4, 2, 2]
    back = Batch.concat(parts)
    same(back.tensors["tokens"], tokens)
    same(back.tensors["logprobs"], b.tensors["logprobs"])
    mask = np.zeros(8, bool)
    mask[[1, 6]] = True
    assert b.select(mask).tensors["tokens"].lengths.tolist() == [1, 2]


def test_split_by_tokens_balances_tokens_not_samples_and_keeps_groups():
    lengths = [400, 390, 10, 12, 8, 9, 11, 10]  # two long samples first, six short ones
    b = Batch(tensors={"tokens": Ragged.from_sequences(seqs(lengths))}, meta={"samples_per_prompt": 2})
    by_count = [p.tensors["tokens"].total for p in b.split(2)]
    by_tokens = [p.tensors["tokens"].total for p in b.split(2, by_tokens=True)]
    assert by_count == [812, 38]
    assert by_tokens == [790, 60]  # the best a cut between groups can do
    assert all(p.num_samples % 2 == 0 for p in b.split(2, by_tokens=True))
    assert [p.num_samples for p in b.split(4, by_tokens=True)] == [2, 2, 2, 2]


def test_concat_refuses_ragged_mixed_with_rectangular():
    r = Batch(tensors={"x": Ragged.from_sequences(seqs([2]))})
    d = Batch(tensors={"x": torch.zeros(1, 2, dtype=torch.int64)})
    with pytest.raises(TypeError, match="ragged in some batches"):
        Batch.concat([r, d])


# ------------------------------------------------------------------------------------------ the codec
@pytest.mark.parametrize("lengths", [[3, 0, 7], [2000, 1, 3000, 5], []])
def test_the_codec_sends_values_and_offsets_as_raw_bytes_and_rebuilds_the_same_kind(lengths):
    tokens = Ragged.from_sequences(seqs(lengths))
    b = Batch(tensors={
        "tokens": tokens,
        "logprobs": tokens.like(torch.randn(tokens.total)),
        "halves": tokens.like(torch.randn(tokens.total).to(torch.bfloat16)),
        "hidden": tokens.like(torch.randn(tokens.total, 3)),
        "np": Ragged.from_sequences(seqs(lengths, dtype=np.float32), lib="numpy"),
        "scores": torch.arange(len(lengths), dtype=torch.float32),
    })
    frames = codec.encode(b)
    header = msgpack.unpackb(frames[0])
    for d in header[TENSORS]:
        assert type(d[AT]) in (bytes, int)  # raw bytes inline, or a frame's
        if d[NAME] == "scores":
            assert d[SUB] is None
            continue
        shape, at = d[SUB]  # offsets: [shape, at], stored as the values are: never a list of ints
        assert type(shape) is list and len(shape) == 1 and type(at) in (bytes, int)
    got = codec.decode(frames)
    assert got.num_samples == len(lengths)
    for name in ("tokens", "logprobs", "halves", "hidden", "np"):
        same(got.tensors[name], b.tensors[name])
    assert got.tensors["hidden"].values.shape == (tokens.total, 3)


def test_large_values_travel_as_their_own_frame_without_a_copy():
    tokens = Ragged.from_sequences(seqs([5000, 3000]))
    frames = codec.encode(Batch(tensors={"tokens": tokens}))
    assert len(frames) == 2  # header (with the small offsets inline) + the values
    assert np.shares_memory(np.asarray(frames[1]), tokens.values.numpy())


def _garble(frames, fix):
    header = msgpack.unpackb(frames[0])
    fix(header[TENSORS][0])
    return [wire.pack(header), *frames[1:]]


def _set(desc: list, **fields) -> None:
    """Replace fields of a tensor descriptor (named as in `wire.TENSOR_FIELDS`)."""
    for name, value in fields.items():
        desc[wire.TENSOR_FIELDS.index(name)] = value


def _set_offsets(desc: list, **fields) -> None:
    """Replace fields of a tensor descriptor's offsets, [shape, at]."""
    for name, value in fields.items():
        desc[SUB][("shape", "at").index(name)] = value


@pytest.mark.parametrize("fix, code", [
    (lambda d: _set_offsets(d, at=np.array([0, 2, 9], np.int64).tobytes()), "bad_offsets"),
    (lambda d: _set_offsets(d, at=np.array([0, 3, 1], np.int64).tobytes()), "bad_offsets"),
    (lambda d: _set_offsets(d, at=np.array([1, 2, 3], np.int64).tobytes()), "bad_offsets"),
    (lambda d: _set_offsets(d, shape=[4]), "size_mismatch"),
    (lambda d: d[SUB].append(1), "bad_field"),  # inline bytes and a frame both (a map had `data` and `frame`)
    (lambda d: _set(d, offsets=[0, 1, 3]), "bad_field"),
    (lambda d: _set(d, offsets=[]), "bad_field"),  # offsets that are not nil are [shape, at], even when falsy
    (lambda d: _set(d, offsets=False), "bad_field"),
    (lambda d: _set_offsets(d, shape=[3, 1]), "shape"),
])
def test_garbled_offsets_are_rejected_by_name_never_a_crash_later(fix, code):
    frames = codec.encode(Batch(tensors={"tokens": Ragged.from_sequences(seqs([2, 1]))}))
    with pytest.raises(DecodeError) as e:
        codec.decode(_garble(frames, fix))
    assert e.value.reason == code and "tokens" in str(e.value)


# ------------------------------------------------------------------------------------------ channels


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm_min_bytes", [None, 64 << 10])
async def test_ragged_batches_round_trip_through_a_real_channel_and_shared_memory(tmp_path, shm_min_bytes):
    from flowrl.transport import Receiver, Sender
    from tests.transport.helpers import fast_config

    cfg = fast_config(capacity_messages=4, **({"shm_min_bytes": shm_min_bytes} if shm_min_bytes else {}))
    tokens = Ragged.from_sequences(seqs([30000, 7, 0, 12000]))
    sent = Batch(tensors={"tokens": tokens, "logprobs": tokens.like(torch.randn(tokens.total)),
                          "scores": torch.ones(4)}, batch_id="ragged")
    async with Receiver(cfg, name="ragged") as rx, Sender(cfg, name="ragged") as tx:
        await tx.connect(await rx.bind(f"ipc://{tmp_path}/ch"))
        await tx.send(sent)
        got = await rx.recv()
        same(got.tensors["tokens"], tokens)
        same(got.tensors["logprobs"], sent.tensors["logprobs"])
        if shm_min_bytes:
            assert rx.statistics().shm == 1
        assert rx.statistics().rejected == 0
        await rx.ack(got)
        del got
        gc.collect()
