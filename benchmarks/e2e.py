"""End to end: GRPO through flowrl (sync and overlapped) next to the same algorithm as one plain loop.

    python benchmarks/e2e.py                       # full: 300 steps each, seed 0 (~4-5 min on 2 cores)
    python benchmarks/e2e.py --quick               # smoke run: 20 steps each (~1 min)
    python benchmarks/e2e.py --json e2e.json --baseline-threads 1 2 --steps 250
    python benchmarks/e2e.py --quick --runs overlapped ray   # the local launcher next to the Ray one

The job is the issue's benchmark setting and `graphs/grpo.yaml`'s defaults: GRPO on 6-digit
reversal, a 2-layer, 128-wide built-in transformer, 8 prompts x 8 samples per step (4 actor
mini-batches, k3 KL loss 0.01 against the reference, entropy bonus 0.01). Back to back, in this
order, with the same seed and the same number of steps:

- ``single-process``: `flowrl.rl.single_process.run` with preset ``grpo`` — one plain loop in this
  process calling the functions the role nodes call, ``torch.set_num_threads(T)`` for each
  ``--baseline-threads`` value T (default 1: one core, like each node of a flowrl run here);
- ``flowrl sync (k=0)``: ``flowrl run graphs/grpo.yaml schedule.max_staleness=0`` — two node
  processes (the rollout, with the prompts, reward, reference and advantages fused in; the actor),
  strictly on-policy;
- ``flowrl overlapped (k=1)``: the same with ``schedule.max_staleness=1`` — the rollout generates
  batch n+1 while the actor trains on batch n.
- ``flowrl ray launcher (k=1)`` (only with ``--runs ray``; needs the ``ray`` extra): the overlapped
  run with ``launcher.type=ray``: a private Ray cluster on loopback is started, every node process
  runs under a Ray actor, and the cluster is stopped at the end. Its start-up s includes the
  cluster's start.

flowrl runs are the real command in a child process (``--quiet``, no checkpoints but the final
one: ``schedule.checkpoint_every=0``); their numbers come from the run directory they leave.

How the numbers are counted:

- **tokens** = prompt + response tokens of every sample (the way verl counts them: the response
  tokens up to and including EOS, padding excluded); **completions** = samples (prompts x 8).
- **completions/s, tokens/s**: the totals over all steps divided by the training time. For
  flowrl the training time runs from the first ticket issued (every node process started, READY
  and wired) to the consumption of the last one; for the single-process loop from the call of
  ``run`` (model building included) to its last step. Start-up is excluded from these two rates
  for both; it is in the next two columns.
- **start-up s**: flowrl only: from launching the ``flowrl run`` command (a fresh Python
  interpreter) to its first ticket issued — interpreter and torch import, graph loading,
  placement, spawning and handshaking two node processes, building their models.
- **s to 0.95**: wall time to the first step whose batch-mean reward (``reward_mean``, the mean
  score of that step's 64 completions) is >= the threshold (0.95 by default), and **step** that
  step's number. For flowrl it is measured from launching the command to the actor's
  ``consumed`` record of that step in the ledger, so it *includes* the start-up; the
  single-process loop's clock starts at ``run`` (torch already imported, model building
  included). ``-`` when the threshold was not reached within the steps.
- **wall s**: the whole run (flowrl: launch to exit, teardown included); **reward (last 10)**: the
  mean reward of the last 10 steps; **cores**: CPU cores the run used (flowrl: its placement plan;
  the loop: its threads).

Timings on a small shared machine are noisy (other processes compete for the 2 cores); run it a
few times, or with ``--seed``, before reading much into a 10 % difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRAPH = ROOT / "graphs" / "grpo.yaml"


def bench_single_process(*, seed: int, steps: int, threshold: float, threads: int) -> dict:
    import torch

    from flowrl.rl.single_process import apply_overrides, preset, run

    torch.set_num_threads(threads)
    cfg = apply_overrides(preset("grpo"), [f"seed={seed}", f"steps={steps}"])
    t0 = time.perf_counter()
    rows = run(cfg)
    wall = time.perf_counter() - t0
    curve = [(int(r["step"]), float(r["wall_s"]), float(r["reward_mean"]), float(r["samples"]), float(r["tokens"]))
             for r in rows]
    return summarize(f"single-process ({threads} thread{'s' if threads > 1 else ''})", curve, threshold,
                     train_s=curve[-1][1], startup_s=None, wall_s=wall, cores=threads,
                     extra={"threads": threads, "config": cfg.model_dump(mode="json")})


def bench_flowrl(*, seed: int, steps: int, threshold: float, k: int | None, run_dir: Path, timeout_s: float,
                 launcher: str = "local", graph: Path = GRAPH) -> dict:
    """``flowrl run graph`` for ``steps``; ``k``: its max_staleness (None: the graph's own)."""
    from flowrl.testing import run_graph
    from flowrl.graph import load_graph

    if k is None:
        k = load_graph(graph).schedule.max_staleness
    overrides = [f"seed={seed}", f"schedule.steps={steps}", f"schedule.max_staleness={k}",
                 "schedule.checkpoint_every=0", f"launcher.type={launcher}"]
    launched = time.time()
    result = run_graph(graph, run_dir, overrides=overrides, timeout_s=timeout_s, cwd=ROOT)
    wall = time.time() - launched
    if result.exit_code != 0:
        raise RuntimeError(f"flowrl run (k={k}) exited {result.exit_code}; run directory {run_dir}\n"
                           f"{result.stderr[-3000:]}")
    ledger = result.ledger
    first_issued = min(r["t"] for r in ledger if r["event"] == "issued")
    done = [r["t"] for r in ledger if r["event"] == "consumed"]  # the n-th consumption is step n
    metrics = sorted(result.metrics, key=lambda r: r["step"])
    if len(metrics) != len(done):
        raise RuntimeError(f"{len(metrics)} metrics rows but {len(done)} consumed tickets in {run_dir}")
    curve = [(int(m["step"]), t - launched, float(m["reward_mean"]), float(m["samples"]), float(m["tokens"]))
             for m, t in zip(metrics, done)]
    plan = json.loads((run_dir / "plan.json").read_text())
    cores = len({d for p in plan["plan"] for d in p.get("devices", [])})
    label = "flowrl sync (k=0)" if k == 0 else f"flowrl overlapped (k={k})"
    if launcher != "local":
        label = f"flowrl {launcher} launcher (k={k})"
    staleness = [r["staleness"] for r in ledger if r["event"] == "consumed"]
    return summarize(label, curve, threshold, train_s=done[-1] - first_issued, startup_s=first_issued - launched,
                     wall_s=wall, cores=cores,
                     extra={"max_staleness": k, "launcher": launcher, "staleness_max_seen": max(staleness),
                            "staleness_mean": round(statistics.mean(staleness), 3), "run_dir": str(run_dir)})


def summarize(label: str, curve: list[tuple], threshold: float, *, train_s: float, startup_s: float | None,
              wall_s: float, cores: int, extra: dict) -> dict:
    """curve: (step, seconds since the run's clock started, reward_mean, samples, tokens) per step."""
    hit = next((c for c in curve if c[2] >= threshold), None)
    samples, tokens = sum(c[3] for c in curve), sum(c[4] for c in curve)
    return {
        "run": label, "steps": len(curve), "threshold": threshold,
        "reached": hit is not None,
        "step_to_threshold": hit[0] if hit else None,
        "seconds_to_threshold": round(hit[1], 2) if hit else None,
        "startup_s": None if startup_s is None else round(startup_s, 2),
        "train_s": round(train_s, 2), "wall_s": round(wall_s, 2),
        "completions": int(samples), "tokens": int(tokens),
        "completions_per_s": round(samples / train_s, 1),
        "tokens_per_s": round(tokens / train_s, 1),
        "reward_last10": round(statistics.mean(c[2] for c in curve[-10:]), 3),
        "cores": cores,
        "curve": [[c[0], round(c[1], 3), round(c[2], 4)] for c in curve],
        **extra,
    }


def _fmt(v) -> str:
    return "-" if v is None else str(v)


def print_table(results: list[dict], threshold: float) -> None:
    head = ["run", "cores", "steps", "completions/s", "tokens/s", "start-up s", f"s to {threshold:g}", "step",
            "wall s", "reward (last 10)"]
    cells = [head] + [[_fmt(c) for c in (r["run"], r["cores"], r["steps"], r["completions_per_s"], r["tokens_per_s"],
                                         r["startup_s"], r["seconds_to_threshold"], r["step_to_threshold"],
                                         r["wall_s"], r["reward_last10"])] for r in results]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    for i, row in enumerate(cells):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    base = next((r for r in results if r["run"].startswith("single-process")), None)
    if base:
        for r in results:
            if r is not base:
                print(f"{r['run']}: {r['completions_per_s'] / base['completions_per_s']:.2f}x the completions/s "
                      f"of {base['run']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 steps each (the threshold is not reached)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 300, --quick 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=0.95, help="batch-mean reward to time (default 0.95)")
    parser.add_argument("--baseline-threads", type=int, nargs="+", default=[1], metavar="T",
                        help="torch threads of the single-process loop; one run per value (default 1)")
    parser.add_argument("--runs", nargs="+", choices=("single", "sync", "overlapped", "ray"),
                        default=["single", "sync", "overlapped"],
                        help="which runs (default the first three; `ray`: the overlapped run under the Ray launcher)")
    parser.add_argument("--keep", metavar="DIR", help="keep the flowrl run directories under DIR")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per flowrl run before it is killed")
    parser.add_argument("--json", metavar="FILE", help="also write the results (with reward curves) as JSON")
    args = parser.parse_args(argv)
    steps = args.steps or (20 if args.quick else 300)

    results = []
    with tempfile.TemporaryDirectory(prefix="flowrl-e2e-") as tmp:
        runs_dir = Path(args.keep) if args.keep else Path(tmp)
        runs_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name in args.runs:
            if name == "single":
                for threads in args.baseline_threads:
                    res = bench_single_process(seed=args.seed, steps=steps, threshold=args.threshold, threads=threads)
                    results.append(res)
                    _progress(res)
            else:
                k = 0 if name == "sync" else 1
                res = bench_flowrl(seed=args.seed, steps=steps, threshold=args.threshold, k=k,
                                   run_dir=runs_dir / f"e2e-{name}-{stamp}", timeout_s=args.timeout,
                                   launcher="ray" if name == "ray" else "local")
                results.append(res)
                _progress(res)
    print_table(results, args.threshold)
    if args.json:
        meta = {"graph": "graphs/grpo.yaml", "seed": args.seed, "steps": steps, "threshold": args.threshold}
        with open(args.json, "w") as f:
            json.dump({**meta, "results": results}, f, indent=1)
    return 0


def _progress(res: dict) -> None:
    print(f"{res['run']}: {res['steps']} steps in {res['wall_s']} s; "
          + (f"reward {res['threshold']} at step {res['step_to_threshold']} ({res['seconds_to_threshold']} s)"
             if res["reached"] else f"reward {res['threshold']} not reached"), file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
