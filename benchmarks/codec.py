"""What a node pays per batch to encode and decode an RL step's batch: the codec alone, in one process.

    python benchmarks/codec.py                 # table, a few seconds
    python benchmarks/codec.py --json out.json

The batch is what graphs/grpo.yaml's advantages node sends the actor: 8 prompts x 8 samples of the
6-digit reversal task, each sample its own length (64 sequences, ~970 tokens in all), as torch
tensors (as the RL nodes send them) and as numpy arrays: tokens, loss_mask (bool), logprobs,
versions, ref_logprobs and advantages ragged over the same offsets; prompt_lens, scores and
targets ([64, 6]) one row per sample. Per batch, best of `--repeat` timings of `--n` batches
each: `encode` (codec.prepare and the frames a sender writes), `decode` (codec.decode: the header
unpacked and every tensor checked and rebuilt, as a receiver does). Warm: the same batch again and
again, the caches hot; a node process, idle between two batches, pays two to five times that.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def grpo_batch(lib: str, seed: int = 0):
    """The advantages node's output for one step of graphs/grpo.yaml (see the module docstring)."""
    from flowrl.transport import Batch, Ragged

    rng = np.random.default_rng(seed)
    lengths = rng.integers(11, 20, size=64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    ragged = {"tokens": rng.integers(0, 14, size=n), "loss_mask": rng.integers(0, 2, size=n).astype(bool),
              "logprobs": rng.standard_normal(n).astype(np.float32), "versions": np.zeros(n, np.int64),
              "ref_logprobs": rng.standard_normal(n).astype(np.float32),
              "advantages": rng.standard_normal(n).astype(np.float32)}
    rows = {"prompt_lens": np.full(64, 8, np.int64), "scores": rng.random(64).astype(np.float32),
            "targets": rng.integers(0, 10, size=(64, 6))}
    if lib == "torch":
        import torch

        as_lib = torch.from_numpy
    else:
        def as_lib(a):
            return a
    shared = as_lib(offsets)  # one offsets array for every ragged tensor, as Ragged.like makes them
    tensors = {k: Ragged(as_lib(v), shared) for k, v in ragged.items()}
    tensors.update({k: as_lib(v) for k, v in rows.items()})
    return Batch(tensors=tensors, meta={"samples_per_prompt": 8, "max_new_tokens": 8}, batch_id="step-1")


def per_batch_us(fn, n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def measure(lib: str, n: int, repeat: int) -> dict:
    from flowrl.transport import codec, decode

    batch = grpo_batch(lib)
    frames = codec.prepare(batch).frames([1, 1])
    received = [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in frames]
    got = decode(received)
    assert sorted(got.tensors) == sorted(batch.tensors) and got.num_samples == 64
    return {"lib": lib, "tensors": len(batch.tensors), "bytes": sum(len(f) for f in received),
            "encode_us": per_batch_us(lambda: codec.prepare(batch).frames([1, 1]), n, repeat),
            "decode_us": per_batch_us(lambda: decode(received), n, repeat)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="batches per timing")
    ap.add_argument("--repeat", type=int, default=5, help="timings per cell; the best is kept")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    rows = [measure(lib, args.n, args.repeat) for lib in ("torch", "numpy")]
    print(f"{'tensors of':<10} {'count':>5} {'bytes':>7} {'encode us':>10} {'decode us':>10}")
    for r in rows:
        print(f"{r['lib']:<10} {r['tensors']:>5} {r['bytes']:>7} {r['encode_us']:>10.1f} {r['decode_us']:>10.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
