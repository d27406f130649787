"""Batch: construction checks and sample-wise select / split / concat."""

import numpy as np
import pytest
import torch

from flowrl.transport import Batch


def make(n=6, kind="numpy"):
    tokens = np.arange(n * 3, dtype=np.int64).reshape(n, 3)
    logprobs = np.linspace(0, 1, n, dtype=np.float32)
    b = Batch(tensors={"tokens": tokens, "logprobs": logprobs}, meta={"task": "reverse"}, batch_id="t1",
              attempt=2, policy_version=7)
    return b.to_torch() if kind == "torch" else b


def test_batch_reports_samples_and_bytes():
    b = make(6)
    assert b.num_samples == 6
    assert b.nbytes == 6 * 3 * 8 + 6 * 4
    assert "tokens: int64[6, 3]" in repr(b)


def test_tensors_must_share_the_leading_dimension():
    with pytest.raises(ValueError, match="leading dim"):
        Batch(tensors={"a": np.zeros(3), "b": np.zeros(4)})


def test_zero_dim_tensors_are_per_batch_values():
    b = Batch(tensors={"x": np.zeros((4, 2)), "loss": np.array(1.5)})
    assert b.num_samples == 4
    part = b.select([1, 2])
    assert part.tensors["loss"] is b.tensors["loss"] and part.num_samples == 2
    assert Batch(tensors={"loss": np.array(1.0)}).num_samples == 0


@pytest.mark.parametrize("bad, error", [
    (dict(tensors={"x": [1, 2]}), TypeError),
    (dict(tensors={"x": np.zeros(2, dtype=np.complex64)}), TypeError),
    (dict(tensors={"": np.zeros(2)}), ValueError),
    (dict(batch_id=""), ValueError),
    (dict(attempt=-1), ValueError),
    (dict(policy_version=1.5), TypeError),
    (dict(meta=[1]), TypeError),
])
def test_invalid_batches_are_refused_with_a_clear_error(bad, error):
    with pytest.raises(error):
        Batch(**bad)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_select_takes_samples_by_index_mask_or_slice(kind):
    b = make(6, kind)
    for index in ([4, 0], np.array([4, 0]), torch.tensor([4, 0]), [-2, 0]):
        part = b.select(index)
        assert part.num_samples == 2 and part.batch_id == "t1" and part.policy_version == 7
        assert [int(v) for v in part.tensors["tokens"][:, 0]] == [12, 0]
    mask = np.array([True, False, True, False, False, False])
    assert b.select(mask).num_samples == 2
    assert b.select(slice(1, 3)).num_samples == 2
    with pytest.raises(IndexError, match="out of range"):
        b.select([6])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_split_then_concat_gives_back_the_same_samples(kind):
    b = make(7, kind)
    parts = b.split(3)
    assert [p.num_samples for p in parts] == [3, 2, 2]
    joined = Batch.concat(parts)
    assert joined.num_samples == 7
    assert np.array_equal(np.asarray(joined.tensors["tokens"]), np.asarray(b.tensors["tokens"]))
    assert [p.num_samples for p in b.split(9)].count(0) == 2


def test_concat_takes_the_oldest_policy_version_and_checks_compatibility():
    a, b = make(2), make(3).replace(policy_version=3)
    assert Batch.concat([a, b]).policy_version == 3
    assert Batch.concat([a, b], batch_id="joined").batch_id == "joined"
    with pytest.raises(ValueError, match="same names"):
        Batch.concat([a, Batch(tensors={"x": np.zeros(2)})])
    with pytest.raises(TypeError, match="numpy in some"):
        Batch.concat([a, b.to_torch()])
    with pytest.raises(ValueError, match="0-d tensor"):
        Batch.concat([Batch(tensors={"s": np.array(1)}), Batch(tensors={"s": np.array(2)})])


def test_replace_keeps_ids_unless_overridden():
    b = make(2)
    c = b.replace(meta={"k": 1})
    assert (c.batch_id, c.attempt, c.policy_version, c.meta) == ("t1", 2, 7, {"k": 1})
    assert b.replace(attempt=3).attempt == 3


def test_numpy_and_torch_conversions_share_memory():
    b = make(3)
    t = b.to_torch()
    assert isinstance(t.tensors["tokens"], torch.Tensor)
    t.tensors["tokens"][0, 0] = 99
    assert b.tensors["tokens"][0, 0] == 99
    assert isinstance(t.to_numpy().tensors["logprobs"], np.ndarray)
    with pytest.raises(TypeError, match="bfloat16"):
        Batch(tensors={"h": torch.zeros(2, dtype=torch.bfloat16)}).to_numpy()
