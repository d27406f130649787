"""benchmarks/codec.py times a GRPO step's batch both ways, torch and numpy, and what it decodes is that batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_modules import benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_the_codec_benchmark_times_encode_and_decode_of_the_grpo_batch_in_both_kinds(tmp_path):
    out = tmp_path / "codec.json"
    proc = subprocess.run([sys.executable, "benchmarks/codec.py", "--n", "20", "--repeat", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["lib"] for r in rows] == ["torch", "numpy"]
    for r in rows:
        assert r["tensors"] == 9 and r["bytes"] > 9 * 64 and r["encode_us"] > 0 and r["decode_us"] > 0


def test_the_benchmark_batch_is_the_grpo_batch_and_decodes_to_its_own_kind():
    grpo_batch = benchmark("codec").grpo_batch
    import torch

    from flowrl.transport import Ragged, decode, encode

    for lib in ("torch", "numpy"):
        b = grpo_batch(lib)
        got = decode([bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in encode(b)])
        assert got.num_samples == 64 and got.tensors["targets"].shape == (64, 6)
        tokens, mask = got.tensors["tokens"], got.tensors["loss_mask"]
        assert type(tokens) is Ragged and mask.offsets is tokens.offsets  # aligned: one offsets array
        assert isinstance(tokens.values, torch.Tensor) == (lib == "torch")
        assert tokens.values.tolist() == b.tensors["tokens"].values.tolist()
        assert mask.values.tolist() == b.tensors["loss_mask"].values.tolist()
