"""vLLM engine: batch-at-a-time tickets vs continuous batching across concurrent tickets (needs vllm).

    python benchmarks/vllm_continuous.py                    # ~1-2 minutes on 2 CPU cores
    python benchmarks/vllm_continuous.py --tickets 48 --concurrency 8 --json out.json

Workload: ``--tickets`` tickets of 4 reverse-task prompts x n=4 samples at temperature 1, each
ticket with its own ``max_new_tokens`` drawn long-tailed (log-normal, median 24, sigma 1, clipped
to 8..192), and within a ticket the responses end where the model samples EOS (the tiny random
Llama of examples/hf_tiny draws it about once in 18 tokens: geometric, another long tail). One
engine (the tiny Llama, 256-token context), built once per mode:

- ``batch``: ``continuous: false``, the tickets one after the other, each one ``LLM.generate``
  call that lasts as long as its longest response (what a rollout did before).
- ``continuous``: ``--concurrency`` tickets awaiting ``submit`` at once on one asyncio loop (a new
  one starts as one returns), their requests sharing vLLM's steps.

Completions/s = samples returned / wall time (best of ``--repeats``); the same tickets, prompts and
seeds in both modes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def workload(tickets: int, seed: int = 0):
    from flowrl.engines import Sampling
    from flowrl.tasks import EOS, PAD
    from flowrl.transport.ragged import Ragged
    from tests.engines.layout import reverse_prompt

    rng = np.random.default_rng(seed)
    jobs = []
    for t in range(tickets):
        max_new = int(np.clip(rng.lognormal(np.log(24), 1.0), 8, 192))
        prompts = Ragged.from_sequences([reverse_prompt(int(rng.integers(1, 7)), 4 * t + i) for i in range(4)])
        jobs.append((prompts, Sampling(n=4, temperature=1.0, max_new_tokens=max_new, eos_id=EOS, pad_id=PAD), t))
    return jobs


def run_batch(engine, jobs) -> tuple[float, int, int]:
    start = time.perf_counter()
    outs = [engine.generate(p, s, seed=seed) for p, s, seed in jobs]
    return time.perf_counter() - start, sum(o.num_samples for o in outs), sum(int(o.response_lens.sum()) for o in outs)


def run_continuous(engine, jobs, concurrency: int) -> tuple[float, int, int]:
    async def main():
        gate = asyncio.Semaphore(concurrency)

        async def one(p, s, seed):
            async with gate:
                return await engine.submit(p, s, seed=seed)
        return await asyncio.gather(*(one(*job) for job in jobs))

    start = time.perf_counter()
    outs = asyncio.run(main())
    return time.perf_counter() - start, sum(o.num_samples for o in outs), sum(int(o.response_lens.sum()) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tickets", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from examples.hf_tiny.make_model import write_model
    from flowrl.engines import build_engine

    model = write_model(Path(tempfile.mkdtemp()) / "model", "tiny", seed=0, max_len=256)
    jobs = workload(args.tickets)
    spec = {"type": "vllm", "kv_cache_memory_bytes": 128 << 20, "max_model_len": 256}
    results = {}
    for mode in ("batch", "continuous"):
        engine = build_engine({**spec, "continuous": mode == "continuous"}, model={"type": "hf", "path": str(model)})
        runs = []
        for _ in range(args.repeats):
            if mode == "batch":
                runs.append(run_batch(engine, jobs))
            else:
                runs.append(run_continuous(engine, jobs, args.concurrency))
        wall, samples, tokens = min(runs)
        stats = engine.stats()
        results[mode] = {"wall_s": round(wall, 3), "completions_per_s": round(samples / wall, 1),
                         "tokens_per_s": round(tokens / wall, 1), "samples": samples, "tokens": tokens}
        if stats:
            results[mode]["engine_busy_s"] = round(stats["busy_s"] / args.repeats, 3)
        engine.close()
        print(f"{mode:>10}: {samples} completions, {tokens} tokens in {wall:.2f} s: "
              f"{samples / wall:.1f} completions/s, {tokens / wall:.0f} tokens/s", flush=True)
    speedup = results["continuous"]["completions_per_s"] / results["batch"]["completions_per_s"]
    print(f"continuous / batch: {speedup:.2f}x (tickets={args.tickets}, concurrency={args.concurrency})")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **results,
                                         "speedup": round(speedup, 2)}, indent=2))


if __name__ == "__main__":
    main()
