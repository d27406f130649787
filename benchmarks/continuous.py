"""Batch-at-a-time vs continuous batching of the builtin engine on long-tailed response lengths.

    python benchmarks/continuous.py                 # ~1-2 minutes, one torch thread
    python benchmarks/continuous.py --quick         # fewer tickets

Model: the built-in tiny transformer (d_model 128, 2 layers, 4 heads, vocabulary 64, max_seq_len
256), rigged so that every position gives EOS probability ``1/--mean`` and the other tokens equal
shares: response lengths are geometric (mean ~``--mean``, cut at ``--max-new``), the long tail of
real RL rollouts. The trunk still runs in full, so the cost per token is real.

- ``tail``: every ticket the same budget (``--max-new``); lengths come from EOS.
- ``budgets``: no EOS; each ticket its own ``max_new_tokens``, log-uniform in 1..``--max-new``.

``batch``: the tickets one after another through ``generate`` (a ticket's batch runs until its
slowest sample is done). ``continuous``: ``--in-flight`` tickets at a time awaiting ``submit`` on one
asyncio loop (a new one submitted when one returns, as the rollout node's calls do), sharing
``--slots`` KV-cache slots. Completions/s and generated tokens/s of wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time

import torch

from flowrl.engines import Sampling, build_engine
from flowrl.transport.ragged import Ragged

MODEL = {"type": "tiny", "d_model": 128, "n_layers": 2, "n_heads": 4, "vocab_size": 64, "max_seq_len": 256}
EOS, PAD = 1, 0


def rig(engine, mean: float) -> None:
    """Every hidden state becomes e_0 and the logits lm_head.weight[:, 0]: EOS with p = 1/mean."""
    model = engine.model
    v = model.vocab_size
    with torch.no_grad():
        model.norm.weight.zero_()
        model.norm.bias.zero_()
        model.norm.bias[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        p = 1.0 / mean
        model.lm_head.weight[EOS, 0] = math.log(p * (v - 1) / (1 - p))


def tickets(count: int, prompts: int, args, budgets: bool) -> list[tuple[Ragged, Sampling]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        lens = torch.randint(8, 33, (prompts,), generator=g).tolist()
        ragged = Ragged.from_sequences([torch.randint(2, 64, (n,), generator=g).tolist() for n in lens], "int64")
        budget = int(math.exp(torch.rand(1, generator=g).item() * math.log(args.max_new))) if budgets else args.max_new
        eos = 10_000 if budgets else EOS  # budgets: an EOS outside the vocabulary never comes
        out.append((ragged, Sampling(n=args.n, temperature=1.0, max_new_tokens=max(budget, 1), eos_id=eos,
                                     pad_id=PAD)))
    return out


def run_batch(work, args) -> tuple[float, int, int]:
    engine = build_engine({"type": "builtin"}, model=MODEL, seed=0)
    rig(engine, args.mean)
    t0 = time.perf_counter()
    outs = [engine.generate(p, s, seed=i) for i, (p, s) in enumerate(work)]
    return time.perf_counter() - t0, sum(o.num_samples for o in outs), sum(int(o.loss_mask.values.sum()) for o in outs)


def run_continuous(work, args) -> tuple[float, int, int]:
    engine = build_engine({"type": "builtin", "continuous": True, "max_num_seqs": args.slots}, model=MODEL, seed=0)
    rig(engine, args.mean)

    async def main():
        limit, outs = asyncio.Semaphore(args.in_flight), []

        async def one(i, p, s):
            async with limit:
                outs.append(await engine.submit(p, s, seed=i))

        await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(work)))
        return outs

    t0 = time.perf_counter()
    outs = asyncio.run(main())
    return time.perf_counter() - t0, sum(o.num_samples for o in outs), sum(int(o.loss_mask.values.sum()) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tickets", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per ticket")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--mean", type=float, default=40.0, help="mean response length (tail scenario)")
    ap.add_argument("--max-new", type=int, default=200)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    count = 6 if args.quick else args.tickets
    print(f"{count} tickets x {args.prompts} prompts x n={args.n}; slots={args.slots}, in flight={args.in_flight}, "
          f"threads={args.threads}")
    print(f"{'scenario':<9} {'engine':<11} {'wall s':>7} {'completions/s':>14} {'tokens/s':>9} {'tokens':>7}")
    for scenario in ("tail", "budgets"):
        work = tickets(count, args.prompts, args, budgets=scenario == "budgets")
        for name, fn in (("batch", run_batch), ("continuous", run_continuous)):
            wall, done, tokens = fn(work, args)
            print(f"{scenario:<9} {name:<11} {wall:7.2f} {done / wall:14.1f} {tokens / wall:9.0f} {tokens:7d}")


if __name__ == "__main__":
    main()
