"""Reference answers travel as the batch's `targets` tensor: UTF-8 bytes, one row per prompt.

    >>> t = encode_answers(["42", "x = 3"])      # int64 [2, 5], -1 after each answer
    >>> decode_answers(t)
    ['42', 'x = 3']

Why a tensor and not batch meta: the built-in rollout carries `targets` along (repeated once per
sample, `repeat_interleave`), and `Batch.select` / `split` / `concat` keep tensors aligned with
their samples while meta is per batch. A row that is not a string (test cases of a code task) is
written as JSON. The `targets_encoding: utf8` meta key marks such batches, so a reward that
expects token ids (the built-in `reward`) is not silently fed bytes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

ENCODING = "utf8"
"""Value of batch meta `targets_encoding` for targets made here."""


def answer_text(value: Any) -> str:
    """A dataset field as the string a reward reads (JSON for lists and dicts)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, ensure_ascii=False, default=str)


def encode_answers(answers: list[str], width: int | None = None) -> np.ndarray:
    """int64 ``[n, max(width, longest)]`` UTF-8 bytes, ``-1`` padding (at least one column)."""
    raw = [a.encode("utf-8") for a in answers]
    w = max([width or 1, *(len(r) for r in raw)])
    out = np.full((len(raw), w), -1, dtype=np.int64)
    for i, r in enumerate(raw):
        out[i, : len(r)] = np.frombuffer(r, dtype=np.uint8)
    return out


def decode_answers(targets: Any) -> list[str]:
    """Inverse of :func:`encode_answers` (numpy array or torch tensor)."""
    arr = np.asarray(targets.cpu() if hasattr(targets, "cpu") else targets)
    if arr.ndim != 2:
        raise ValueError(f"targets must be [n, A] bytes, got shape {arr.shape}")
    out = []
    for row in arr:
        row = row[row >= 0]
        if row.size and row.max() > 255:
            raise ValueError("targets hold values > 255: these are token ids, not UTF-8 answer bytes; feed "
                             "the rewards node from a `dataset` source (or use the built-in `reward` node)")
        out.append(row.astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
    return out
