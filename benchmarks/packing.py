"""Padded vs packed actor updates on long-tailed sequence lengths: trainer tokens/s and peak memory.

    python benchmarks/packing.py              # ~2 minutes (one torch thread)
    python benchmarks/packing.py --quick      # ~30 s: fewer, shorter steps
    python benchmarks/packing.py --json out.json --budgets 4096 1024

Batch: prompts of 16-64 tokens, responses log-normal (median 64 tokens, sigma 1) clipped to
8..512; random tokens (the cost of an update does not depend on what they say). Model: the
built-in tiny transformer at a size where compute dominates (d_model 256, 4 layers, 4 heads,
vocabulary 256, max_seq_len 640). One ``ActorTrainer.train_step`` per measured step, 2 mini-batches,
old log-probs from the rollout (no recompute pass).

- ``padded``: the old path -- every sequence right-padded to the longest of the batch (the padding
  masked out of the loss), one micro-batch per mini-batch, the model run on the ``[b, L_max]``
  grid (a model without a packed kernel, so ``forward_packed`` pads; no budget).
- ``packed B``: ``max_tokens_per_microbatch=B``: each mini-batch's sequences (no padding) packed
  first-fit decreasing into micro-batches of at most B tokens, gradients accumulated. With a
  backend that has a packed kernel (``forward_packed`` overridden) each micro-batch is one packed
  sequence; without one, each micro-batch runs right-padded to its own longest sequence (the bins
  hold similar lengths, so little is wasted). The "computed" column says which: model positions
  run per real token.

Tokens/s counts real tokens only (prompt + response, never padding) per second of a step's wall
time, tok/cpu-s per second of the process's CPU time (``time.process_time``), each the best of the
timed steps (the one least disturbed by other load). One torch thread by default: on a shared
machine idle OpenMP threads spin, which inflates both clocks (``--threads 2`` to use both cores).
Peak memory: measured apart, one update in a fresh process per mode; the column is how much that
update grows the process's peak resident set (``resource.getrusage(...).ru_maxrss``), so it covers
activations, gradients and the optimizer's state (the same in every mode) -- not tracemalloc, which
does not see torch's allocations.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def batch(n: int, seed: int, padded: bool):
    """``n`` sequences of the long-tailed lengths above, as the actor's ragged inputs."""
    import torch

    from flowrl.transport.ragged import Ragged

    rng = np.random.default_rng(seed)
    p_lens = rng.integers(16, 65, n)
    r_lens = np.clip(np.round(rng.lognormal(np.log(64), 1.0, n)), 8, 512).astype(np.int64)
    lens = p_lens + r_lens
    width = int(lens.max()) if padded else None
    seqs, masks = [], []
    for p, k in zip(p_lens, lens):
        real = rng.integers(0, 256, int(k))
        pad = (width - int(k)) if padded else 0
        seqs.append(np.concatenate([real, np.zeros(pad, dtype=np.int64)]))
        masks.append(np.concatenate([np.arange(k) >= p, np.zeros(pad, dtype=bool)]))
    tokens = Ragged.from_sequences(seqs, dtype="int64")
    mask = tokens.like(torch.from_numpy(np.concatenate(masks)))
    old = tokens.like(torch.from_numpy(-rng.random(tokens.total).astype(np.float32) * 3) * mask.values)
    return {"tokens": tokens, "loss_mask": mask, "old_logprobs": old,
            "advantages": torch.from_numpy(rng.standard_normal(n).astype(np.float32))}, int(lens.sum())


def child(mode: str, budget: int | None, n: int, steps: int, threads: int) -> dict:
    """One mode in this process: a small warm-up step, then ``steps`` timed ones."""
    import torch

    from flowrl.models import TinyLMSpec
    from flowrl.models.base import CausalLM
    from flowrl.models.packing import has_packed_kernel
    from flowrl.models.tiny import TinyLM
    from flowrl.rl import ActorConfig, ActorTrainer

    torch.set_num_threads(threads)

    class PaddedTinyLM(TinyLM):
        forward_packed = CausalLM.forward_packed  # no packed kernel: the trainer pads each micro-batch

    spec = TinyLMSpec(vocab_size=256, d_model=256, n_layers=4, n_heads=4, max_seq_len=640)
    model = (PaddedTinyLM if mode == "padded" else TinyLM)(spec, seed=0)
    computed = [0]
    model.register_forward_pre_hook(lambda _m, args: computed.__setitem__(0, computed[0] + args[0].numel()))
    actor = ActorTrainer(model, ActorConfig(lr=1e-5, mini_batches=2, max_tokens_per_microbatch=budget), seed=0)
    actor.train_step(**batch(8, seed=99, padded=mode == "padded")[0])  # warm-up (first-call costs), not timed
    data = [batch(n, seed=s, padded=mode == "padded") for s in range(1, steps + 1)]
    walls, cpus, reals, computed[0] = [], [], [], 0
    for b, tokens in data:
        t0, c0 = time.perf_counter(), time.process_time()
        actor.train_step(**b)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        reals.append(tokens)
    kernel = has_packed_kernel(model)
    real = sum(reals)
    return {"mode": mode, "budget": budget, "step_s": sum(walls) / len(walls),  # the best step of each: the
            "tokens_per_s": max(r / w for r, w in zip(reals, walls)),        # least disturbed by other load
            "tokens_per_cpu_s": max(r / c for r, c in zip(reals, cpus)),
            "real_tokens_per_step": real / len(walls),
            "computed_per_real": (real if kernel else computed[0]) / real, "kernel": kernel}


def peak_growth(mode: str, budget: int | None, n: int, threads: int) -> float:
    """MiB the peak resident set grows by over one update, measured in a fresh process (so no earlier
    update set the peak)."""
    import torch

    from flowrl.models import TinyLMSpec
    from flowrl.models.base import CausalLM
    from flowrl.models.tiny import TinyLM
    from flowrl.rl import ActorConfig, ActorTrainer

    torch.set_num_threads(threads)

    class PaddedTinyLM(TinyLM):
        forward_packed = CausalLM.forward_packed

    spec = TinyLMSpec(vocab_size=256, d_model=256, n_layers=4, n_heads=4, max_seq_len=640)
    model = (PaddedTinyLM if mode == "padded" else TinyLM)(spec, seed=0)
    actor = ActorTrainer(model, ActorConfig(lr=1e-5, mini_batches=2, max_tokens_per_microbatch=budget), seed=0)
    b, _ = batch(n, seed=1, padded=mode == "padded")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    actor.train_step(**b)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def run_child(args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=False, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"benchmark child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~30 s: 16 sequences, 1 timed step per mode")
    parser.add_argument("--budgets", type=int, nargs="+", default=[4096, 1024],
                        help="max_tokens_per_microbatch of the packed rows")
    parser.add_argument("--seqs", type=int, default=None, help="sequences per batch (default 64, --quick 16)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 2, --quick 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: idle threads spin, which a shared machine punishes)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "BUDGET"), help=argparse.SUPPRESS)
    parser.add_argument("--memory", nargs=2, metavar=("MODE", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    n = args.seqs or (16 if args.quick else 64)
    steps = args.steps or (1 if args.quick else 2)
    if args.child or args.memory:
        mode, budget = args.child or args.memory
        budget = None if budget == "none" else int(budget)
        if args.child:
            print(json.dumps(child(mode, budget, n, steps, args.threads)))
        else:
            print(json.dumps({"peak_mib": peak_growth(mode, budget, n, args.threads)}))
        return 0
    common = ["--seqs", str(n), "--steps", str(steps), "--threads", str(args.threads)]
    modes = [("padded", "none")] + [("packed", str(b)) for b in args.budgets]
    rows = []
    for mode, budget in modes:
        row = run_child(["--child", mode, budget, *common])
        row["peak_mib"] = run_child(["--memory", mode, budget, *common])["peak_mib"]
        rows.append(row)
    base = rows[0]["tokens_per_s"]
    print(f"{n} sequences per batch, {rows[0]['real_tokens_per_step']:.0f} real tokens per step (mean), "
          f"{steps} timed step(s) per mode, {args.threads} thread(s)")
    print(f"{'mode':<15} {'budget':>6} {'step s':>7} {'tokens/s':>9} {'vs padded':>9} {'tok/cpu-s':>9} "
          f"{'vs padded':>9} {'computed':>8} {'peak MiB':>8}")
    for r in rows:
        name = r["mode"] + (" (kernel)" if r["mode"] == "packed" and r["kernel"] else "")
        print(f"{name:<15} {r['budget'] if r['budget'] else '-':>6} {r['step_s']:>7.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['tokens_per_s'] / base:>8.2f}x {r['tokens_per_cpu_s']:>9.0f} "
              f"{r['tokens_per_cpu_s'] / rows[0]['tokens_per_cpu_s']:>8.2f}x {r['computed_per_real']:>7.2f}x "
              f"{r['peak_mib']:>8.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
