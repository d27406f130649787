"""`Node.requires`: a dtype takes either layout; `ragged` / `dense` also fix the layout."""

import numpy as np
import torch

import flowrl
from flowrl.runtime.worker.datapath import missing_tensors

TOKENS = flowrl.Ragged.from_sequences([[1, 2, 3], [4]], dtype="int64")


def batch(**tensors):
    return flowrl.Batch(tensors=tensors)


def test_a_dtype_takes_either_layout_and_names_what_is_wrong():
    assert missing_tensors(batch(tokens=TOKENS), {"tokens": "int64"}) is None
    assert missing_tensors(batch(tokens=np.zeros((2, 3), np.int64)), {"tokens": "int64"}) is None
    assert missing_tensors(batch(tokens=TOKENS), {"tokens": None}) is None
    assert "is float32, the node takes int64" in missing_tensors(
        batch(tokens=TOKENS.like(torch.zeros(4))), {"tokens": "int64"})
    assert "no tensor 'scores'" in missing_tensors(batch(tokens=TOKENS), {"scores": "float32"})


def test_ragged_and_dense_fix_the_layout():
    assert missing_tensors(batch(tokens=TOKENS), {"tokens": "ragged int64"}) is None
    assert "takes it ragged" in missing_tensors(batch(tokens=np.zeros((2, 3), np.int64)), {"tokens": "ragged int64"})
    assert "takes it rectangular" in missing_tensors(batch(tokens=TOKENS), {"tokens": "dense int64"})
    assert missing_tensors(batch(tokens=np.zeros((2, 3), np.int64)), {"tokens": "dense int64"}) is None
