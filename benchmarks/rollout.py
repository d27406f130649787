"""Rollout engines on CPU: generation tokens/s per engine and model, and end-to-end GRPO speed.

    pip install -e ".[vllm]"
    python benchmarks/rollout.py                       # ~5 minutes on 2 cores
    python benchmarks/rollout.py --skip-e2e --skip-100m --json out.json

Generation: the same reverse-task prompts (6 digits, 9 tokens) for every engine, `--prompts`
prompts x `--samples` completions of at most `--max-new` tokens at temperature 1, one warm-up then
`--repeats` timed calls; tokens/s counts the tokens generated (random weights: responses end at a
random EOS, each engine is credited only what it produced). Engines: `hf` (transformers'
generate) and `vllm` on the tiny example Llama (2 x 128) and a 113M-parameter Llama (12 x 768),
both written locally with random weights by examples/hf_tiny/make_model.py; `builtin` (flowrl's
own sampler) on the built-in tiny transformer (2 x 128) and on the tiny Llama. `--threads` torch
threads (default 1, as in a rollout node) for the hf / builtin engines; vLLM's CPU worker binds
its own OpenMP threads to every core the process may use.

End to end: `graphs/grpo-vllm.yaml` (vLLM rollout, tiny Llama, 3-digit reversal) vs
`graphs/grpo.yaml` (built-in model and sampler, 6-digit reversal), `--e2e-steps` steps each;
completions/s over the steps after the first (start-up excluded), and the start-up seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts(n: int):
    from flowrl.tasks import build_task

    return build_task({"name": "reverse", "digits": 6}).prompts(0, 0, n)[0]


def time_engine(engine, args, threads: int) -> dict:
    import torch

    from flowrl.engines import Sampling
    from flowrl.tasks import EOS, PAD

    torch.set_num_threads(threads)
    batch = prompts(args.prompts)
    s = Sampling(n=args.samples, temperature=1.0, max_new_tokens=args.max_new, eos_id=EOS, pad_id=PAD)
    engine.generate(batch, s, seed=0)  # warm-up
    rates, tokens = [], 0
    for i in range(args.repeats):
        t0 = time.perf_counter()
        out = engine.generate(batch, s, seed=i + 1)
        dt = time.perf_counter() - t0
        n = int(out.loss_mask.values.sum())  # response tokens only
        tokens += n
        rates.append(n / dt)
    return {"tokens_per_s": statistics.median(rates), "completions": batch.shape[0] * args.samples,
            "mean_len": tokens / (args.repeats * batch.shape[0] * args.samples)}


def generation(args, models: dict[str, Path]) -> list[dict]:
    from flowrl.engines import build_engine

    rows = []
    cases = [("builtin", "flowrl tiny 2x128", {"type": "tiny", "d_model": 128, "n_layers": 2, "n_heads": 4})]
    for label, path in models.items():
        cases += [("builtin", label, {"type": "hf", "path": str(path)}), ("hf", label, {"type": "hf", "path": str(path)})]
    for label, path in models.items():  # vLLM last: it re-pins this process's threads
        cases.append(("vllm", label, {"type": "hf", "path": str(path)}))
    for engine_type, label, model in cases:
        if engine_type in args.skip_engines:
            continue
        spec = {"type": engine_type}
        if engine_type == "vllm":
            spec.update(kv_cache_memory_bytes=256 << 20, max_model_len=128)
        t0 = time.perf_counter()
        engine = build_engine(spec, model=model, seed=0)
        start = time.perf_counter() - t0
        row = {"engine": engine_type, "model": label, "startup_s": start, **time_engine(engine, args, args.threads)}
        engine.close()
        del engine
        print(f"  {engine_type:8s} {label:22s} {row['tokens_per_s']:9.0f} tok/s  (start {start:5.1f} s, "
              f"mean len {row['mean_len']:.1f})", flush=True)
        rows.append(row)
    return rows


def e2e(args) -> list[dict]:
    from flowrl.testing import run_graph

    rows = []
    graphs = [("grpo-vllm", ROOT / "graphs" / "grpo-vllm.yaml"), ("grpo (builtin)", ROOT / "graphs" / "grpo.yaml")]
    for name, graph in graphs:
        with tempfile.TemporaryDirectory() as tmp:
            over = [f"schedule.steps={args.e2e_steps}", "schedule.checkpoint_every=0"]
            if name == "grpo-vllm":
                over += [f"nodes.{n}.config.model={{type: hf, path: \"{args.tiny}\"}}" for n in ("rollout", "reference", "actor")]
            res = run_graph(graph, Path(tmp) / "run", overrides=over, timeout_s=600, cwd=ROOT)
            if res.exit_code != 0:
                print(f"  {name}: exit {res.exit_code}\n{res.stderr[-2000:]}")
                continue
            m = sorted(res.metrics, key=lambda r: r["step"])
            steady = m[-1]["wall_s"] - m[0]["wall_s"]
            samples = sum(r["samples"] for r in m[1:])
            row = {"graph": name, "steps": len(m), "startup_s": m[0]["wall_s"], "completions_per_s": samples / steady,
                   "step_s": steady / (len(m) - 1), "reward_last": m[-1]["reward_mean"]}
            print(f"  {name:16s} {row['completions_per_s']:7.1f} completions/s  {row['step_s']:.3f} s/step  "
                  f"(start-up {row['startup_s']:.1f} s)", flush=True)
            rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models-dir", default=str(ROOT / "models"), help="where the example models are (written if missing)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--e2e-steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the hf / builtin engines (vLLM binds "
                   "its own: every core the process may use)")
    p.add_argument("--skip-100m", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-engines", nargs="*", default=[], choices=["builtin", "hf", "vllm"])
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from examples.hf_tiny.make_model import write_model

    mdir = Path(args.models_dir)
    models = {"llama tiny 2x128": mdir / "hf-tiny"}
    if not args.skip_100m:
        models["llama 113M 12x768"] = mdir / "llama-113m"
    for (label, path), preset in zip(models.items(), ("tiny", "100m")):
        if not (path / "config.json").exists():
            print(f"writing {label} to {path}", flush=True)
            write_model(path, preset)
    args.tiny = str(models["llama tiny 2x128"])
    print(f"generation: {args.prompts} prompts x {args.samples} samples, <= {args.max_new} new tokens, temperature 1")
    gen = generation(args, models)
    ends = [] if args.skip_e2e else (print(f"end to end: {args.e2e_steps} GRPO steps each"), e2e(args))[1]
    print("\n| engine | model | generated tokens/s | start-up s |\n|---|---|---:|---:|")
    for r in gen:
        print(f"| {r['engine']} | {r['model']} | {r['tokens_per_s']:.0f} | {r['startup_s']:.1f} |")
    if ends:
        print("\n| graph | completions/s | s/step | start-up s |\n|---|---:|---:|---:|")
        for r in ends:
            print(f"| {r['graph']} | {r['completions_per_s']:.1f} | {r['step_s']:.3f} | {r['startup_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"generation": gen, "e2e": ends}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
