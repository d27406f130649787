"""Throughput and time-to-reward of the plain single-process PPO / GRPO loop (the e2e baseline).

    python benchmarks/single_process.py                       # PPO and GRPO presets, seeds 0 1 2
    python benchmarks/single_process.py --algo grpo --seeds 0 --json grpo.json
    python benchmarks/single_process.py --algo ppo actor.lr=5e-4   # key.path=value overrides

One thread (``torch.set_num_threads(1)``, like each node of a flowrl run on a small machine).
Each run stops at its reward threshold (PPO 0.9, GRPO 0.95 by default: the issue's targets) or
its time limit. Columns: steps and seconds to the threshold (first step whose batch-mean reward
reaches it; seconds include model building), completions/s and tokens/s (prompt + response
tokens, counted as verl does) over the whole run. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from flowrl.rl.single_process import apply_overrides, preset, run

THRESHOLDS = {"ppo": 0.9, "grpo": 0.95}


def bench_one(algo: str, seed: int, threshold: float, time_limit: float, overrides: list[str]) -> dict:
    cfg = apply_overrides(preset(algo), [f"seed={seed}", f"target_reward={threshold}",
                                         f"time_limit_s={time_limit}", "steps=1000000", *overrides])
    rows = run(cfg)
    last = rows[-1]
    hit = last["reward_mean"] >= threshold
    wall = last["wall_s"]
    return {
        "algo": algo, "seed": seed, "threshold": threshold, "reached": hit,
        "steps_to_threshold": int(last["step"]) if hit else None,
        "seconds_to_threshold": round(wall, 2) if hit else None,
        "steps": int(last["step"]), "wall_s": round(wall, 2),
        "completions_per_s": round(sum(r["samples"] for r in rows) / wall, 1),
        "tokens_per_s": round(sum(r["tokens"] for r in rows) / wall, 1),
        "final_reward": round(last["reward_mean"], 3),
        "curve": [[int(r["step"]), round(r["wall_s"], 2), round(r["reward_mean"], 3)] for r in rows],
        "config": cfg.model_dump(mode="json"),
    }


def _fmt(v) -> str:
    return "-" if v is None else str(v)


def print_table(results: list[dict]) -> None:
    head = ["algo", "seed", "threshold", "steps to thr", "s to thr", "completions/s", "tokens/s", "final reward"]
    rows = [[r["algo"], r["seed"], r["threshold"], r["steps_to_threshold"], r["seconds_to_threshold"],
             r["completions_per_s"], r["tokens_per_s"], r["final_reward"]] for r in results]
    for algo in sorted({r["algo"] for r in results}):
        mine = [r for r in results if r["algo"] == algo]
        secs = [r["seconds_to_threshold"] for r in mine if r["reached"]]
        rows.append([algo, "median", mine[0]["threshold"],
                     statistics.median(r["steps_to_threshold"] for r in mine if r["reached"]) if secs else None,
                     round(statistics.median(secs), 2) if secs else None,
                     round(statistics.median(r["completions_per_s"] for r in mine), 1),
                     round(statistics.median(r["tokens_per_s"] for r in mine), 1), f"{len(secs)}/{len(mine)} reached"])
    cells = [head] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", choices=("ppo", "grpo", "both"), default="both")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threshold", type=float, default=None, help="default: PPO 0.9, GRPO 0.95")
    parser.add_argument("--time-limit", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="FILE", help="also write the results (with curves) as JSON")
    parser.add_argument("overrides", nargs="*", help="key.path=value applied to the preset, e.g. actor.lr=5e-4")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    algos = ["ppo", "grpo"] if args.algo == "both" else [args.algo]
    results = []
    for algo in algos:
        for seed in args.seeds:
            res = bench_one(algo, seed, args.threshold or THRESHOLDS[algo], args.time_limit, args.overrides)
            print(f"{algo} seed {seed}: {'reached' if res['reached'] else 'did not reach'} {res['threshold']} "
                  f"after {res['steps']} steps, {res['wall_s']} s", file=sys.stderr, flush=True)
            results.append(res)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
