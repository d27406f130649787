"""Randomised chaos: random kills in short GRPO runs (`--trials`), or random graph shapes under
random fault schedules (`--shapes`), every ledger and state audited.

    python benchmarks/chaos.py --trials 20            # GRPO, random kill -9: prints the table
    python benchmarks/chaos.py --trials 3 --json out.json
    python benchmarks/chaos.py --shapes 300           # 300 shape x fault schedules (3 per shape)
    python benchmarks/chaos.py --shapes 30 --seed 1 --jobs 2 --json shapes.json
    python benchmarks/chaos.py --shapes 60 --seed 7 --jobs 2 --ranks --scale   # + data parallel, flowrl scale

`--shapes N` (see `flowrl.testing.chaos`): N schedules over ceil(N / --per-shape) random DAGs of
synthetic nodes (chains, fan-out, joins, 1-3 sinks, stateful transforms, drops, replicas), each run
fault-free first (the reference) and then under 1-3 random faults (kill, two kills in one
checkpoint interval, kill during a checkpoint commit, SIGSTOP, stuck in process, a dropped message,
a corrupt frame, or a node that hangs in every incarnation). `--ranks` adds data-parallel nodes (2-3
ranks, a collective in `process`; a weight-publishing data-parallel sink and its subscriber in half
the shapes) and kills of one rank; `--scale` gives every schedule a `flowrl scale` up and down of a
stateless node mid-run (and, in half of them, a kill of a replica just added). Half of the shapes
(drawn from the seed; `--ragged all` / `none` forces it) are ragged: their batches carry a
`flowrl.Ragged` next to `x`, which every node keeps aligned and every stateful node and sink checks.
Half of the shapes (`--concurrency all` / `none` forces it) give some stateless nodes `concurrency:
2..6`, their calls overlapping; half of the shapes that can (`--fusion all` / `none`) run some stateless
transforms inside their producer's process (`fuse_into`); `--groups` makes half of the shapes `schedule.ticket: group` (one
prompt per ticket, a stateful sink takes an update's tickets in one call).
Prints schedules, completed, failed with a clear error, failed without one, hung (must be 0), state
mismatches (must be 0), ledger violations (must be 0), runs past their time bound and how many
shapes were ragged; exit 0 only when all of those hold and every recoverable schedule completed.

Each `--trials` trial runs `graphs/grpo.yaml` (a small, quick variant: 4 digits, 1 layer) for real with
one fault `kill:NODE@t=T` — NODE drawn from every node of the graph, T uniform in [0.5, 4] s after
the node reported READY — and then checks:

- completed: the run reached its configured end (exit 0);
- exactly once: every ticket the scheduler issued was consumed exactly once, net of rollbacks
  (`flowrl.testing.audit_ledger`);
- recovery: seconds from the controller noticing the death (`node_down` in the ledger) to the next
  consumed ticket — the time the pipeline stood still. p50 / p95 over trials. Target p50 <= 5 s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from flowrl.testing import run_graph

ROOT = Path(__file__).resolve().parents[1]
NODES = ["rollout", "actor"]  # graphs/grpo.yaml's processes (every other node runs fused in the rollout's)
OVERRIDES = ["schedule.steps=80", "schedule.batch_size=4", "schedule.checkpoint_every=5",
             "vars.model.d_model=64", "vars.model.n_layers=1", "vars.task.digits=4",
             "supervision.heartbeat_s=0.2", "supervision.deadline_s=3"]


def recovery_s(ledger: list[dict]) -> float | None:
    down = [r["t"] for r in ledger if r["event"] == "node_down"]
    if not down:
        return None
    after = [r["t"] for r in ledger if r["event"] == "consumed" and r["t"] > down[0]]
    return after[0] - down[0] if after else None


def trial(i: int, rng: random.Random, workdir: Path) -> dict:
    node = rng.choice(NODES)
    t = round(rng.uniform(0.5, 4.0), 2)
    fault = f"kill:{node}@t={t}"
    result = run_graph(ROOT / "graphs" / "grpo.yaml", workdir / f"trial{i}", overrides=OVERRIDES, faults=[fault],
                       timeout_s=300)
    audit = result.audit()
    rec = recovery_s(result.ledger)
    killed = any(r["event"] == "node_down" for r in result.ledger)
    return {"trial": i, "fault": fault, "exit_code": result.exit_code, "killed": killed,
            "exactly_once": audit.exactly_once, "lost": audit.lost, "duplicated": audit.duplicated,
            "recovery_s": rec, "steps": len(result.metrics)}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def shapes_main(args) -> int:
    from dataclasses import asdict

    from flowrl.testing.chaos import Features, campaign

    features = Features.detect()
    per = max(1, args.per_shape)
    n_shapes = -(-args.shapes // per)
    seeds = [args.seed * 100_000 + i for i in range(n_shapes)]
    if features.missing():
        print(f"runtime lacks {', '.join(features.missing())}: graphs leave those knobs out and faults that "
              f"need them are substituted (see each schedule)", flush=True)
    def show(shape, res):
        mark = "ok " if res.ok else "BAD"
        why = "; ".join(res.reasons)[:300]
        name = res.schedule if res.schedule != "ref" else f"s{res.shape}.ref"
        what = " ".join(res.scales + res.faults) if res.faults or res.scales else f"(fault-free; {', '.join(res.traits)})"
        print(f"{mark} {name:<10} {res.outcome:<14} {res.wall_s:6.1f} s  {what}" + (f"\n      {why}" if why else ""),
              flush=True)
        if res.scaled and not res.ok:
            print("      scale events: " + "; ".join(res.scaled), flush=True)
        if res.hang:
            print("      waiting when killed:\n        " + "\n        ".join(res.hang), flush=True)
        if res.stuck and not res.ok:
            print("      inside a collective when its group went away:\n        " + "\n        ".join(res.stuck), flush=True)

    keep = Path(args.keep) if args.keep else None
    with tempfile.TemporaryDirectory(prefix="flowrl-shapes-") as d:
        workdir = keep or Path(d)
        ragged = {"seed": None, "all": True, "none": False}[args.ragged]
        concurrency = {"seed": None, "all": True, "none": False}[args.concurrency]
        fusion = {"seed": None, "all": True, "none": False}[args.fusion]
        results = campaign(seeds, per, workdir, jobs=args.jobs, features=features, on_result=show, total=args.shapes,
                           holds=args.holds, ranks=args.ranks, scale=args.scale, ragged=ragged,
                           concurrency=concurrency, groups=args.groups, fusion=fusion)
    refs = [r for r in results if r.schedule == "ref"]
    runs = [r for r in results if r.schedule != "ref"]
    count = lambda pred: sum(1 for r in runs if pred(r))
    summary = {
        "schedules": len(runs),
        "completed": count(lambda r: r.outcome == "completed"),
        "failed with a clear error": count(lambda r: r.outcome == "failed_clear"),
        "failed without a clear error": count(lambda r: r.outcome == "failed_unclear"),
        "hung (must be 0)": count(lambda r: r.outcome == "hung"),
        "state mismatches (must be 0)": count(lambda r: bool(r.state)),
        "ledger violations (must be 0)": count(lambda r: bool(r.ledger)),
        "past the time bound": count(lambda r: r.late),
        "weight versions not whole (must be 0)": count(lambda r: bool(r.weights)),
        "scale requests unanswered/refused": count(lambda r: bool(r.scale_errors)),
        "recoverable but failed": count(lambda r: r.recoverable and r.outcome == "failed_clear"),
        "references ok": f"{sum(r.ok for r in refs)}/{len(refs)}",
        "ragged shapes": f"{sum('ragged' in r.traits for r in refs)}/{len(refs)}",
        "concurrent shapes (calls overlapped)": f"{sum('concurrent' in r.traits for r in refs)} "
                                                f"({sum(max(r.overlap.values(), default=1) > 1 for r in refs)})",
        "group-ticket shapes": f"{sum('groups' in r.traits for r in refs)}/{len(refs)}",
        "contract holds": f"{count(lambda r: r.ok)}/{len(runs)}",
    }
    if args.scale:
        events = sum(len(r.scales) for r in runs)
        summary["scale events fired"] = f"{sum(r.scales_fired for r in runs)}/{events}"
    print()
    for k, v in summary.items():
        print(f"{k:<40}{v}")
    print("\nbreakdown (schedules where the contract holds / schedules):")
    groups: dict[str, list] = {}
    for r in runs:
        for key in {f"fault {k}" for k in r.kinds} | {f"shape {t}" for t in r.traits}:
            groups.setdefault(key, []).append(r.ok)
    for key in sorted(groups):
        print(f"  {key:<32}{sum(groups[key])}/{len(groups[key])}")
    for title, lines_of in (
            ("runs that did not complete with a rank inside a collective its partners never reached:",
             lambda r: r.stuck if not r.ok else []),
            ("hung runs: where each process waited when it was killed (full dumps: RUN.hang.txt):", lambda r: r.hang)):
        listed = [r for r in results if lines_of(r)]
        if listed:
            print("\n" + title)
        for r in listed:
            print(f"  {r.schedule if r.schedule != 'ref' else f's{r.shape}.ref'} {r.outcome} {' '.join(r.scales + r.faults)}")
            for line in lines_of(r):
                print(f"    {line}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "features": asdict(features),
                                               "results": [asdict(r) for r in results]}, indent=1))
    return 0 if all(r.ok for r in results) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="GRPO random-kill trials (the default mode)")
    ap.add_argument("--shapes", type=int, metavar="N", help="run N random shape x fault schedules instead")
    ap.add_argument("--per-shape", type=int, default=3, help="--shapes: schedules per random shape")
    ap.add_argument("--jobs", type=int, default=2, help="--shapes: shapes run in parallel")
    ap.add_argument("--holds", action="store_true",
                    help="--shapes: shapes with Hold nodes (tickets dropped with replace=True, like DAPO)")
    ap.add_argument("--ranks", action="store_true",
                    help="--shapes: data-parallel nodes (2-3 ranks) whose process runs a collective, a weight-publishing "
                         "data-parallel sink with a subscriber, kills of one rank")
    ap.add_argument("--scale", action="store_true",
                    help="--shapes: every schedule scales a stateless node up and down mid-run (flowrl scale), "
                         "half of them killing a replica just added")
    ap.add_argument("--ragged", choices=("seed", "all", "none"), default="seed",
                    help="--shapes: ragged batches in the shapes the seed picks (half), in all, or in none")
    ap.add_argument("--concurrency", choices=("seed", "all", "none"), default="seed",
                    help="--shapes: `concurrency: 2..6` on some stateless nodes in the shapes the seed picks (half), "
                         "in every shape that has one, or in none")
    ap.add_argument("--fusion", choices=("seed", "all", "none"), default="seed",
                    help="--shapes: stateless transforms run inside their producer's process (fuse_into) in the "
                         "shapes the seed picks (half of those that can), in every shape that can, or in none")
    ap.add_argument("--groups", action="store_true",
                    help="--shapes: half of the shapes without Hold use `schedule.ticket: group` (a stateful sink "
                         "takes an update's tickets in one call)")
    ap.add_argument("--keep", metavar="DIR", help="--shapes: keep every run directory under DIR")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if args.shapes:
        return shapes_main(args)
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="flowrl-chaos-") as d:
        for i in range(args.trials):
            row = trial(i, rng, Path(d))
            rows.append(row)
            rec = f"{row['recovery_s']:.2f}" if row["recovery_s"] is not None else "-"
            print(f"trial {i:>2}  {row['fault']:<26} exit {row['exit_code']:>3}  killed {row['killed']!s:<5} "
                  f"exactly-once {row['exactly_once']!s:<5} recovery {rec:>6} s", flush=True)
    recs = [r["recovery_s"] for r in rows if r["recovery_s"] is not None]
    completed = sum(r["exit_code"] == 0 for r in rows)
    once = sum(r["exactly_once"] for r in rows)
    print()
    print(f"{'trials':<28}{len(rows)}")
    print(f"{'completed (exit 0)':<28}{completed}/{len(rows)}")
    print(f"{'exactly once (ledger)':<28}{once}/{len(rows)}")
    print(f"{'kills that hit a live node':<28}{sum(r['killed'] for r in rows)}/{len(rows)}")
    if recs:
        print(f"{'recovery p50 / p95 / max':<28}{statistics.median(recs):.2f} / {pct(recs, 0.95):.2f} / {max(recs):.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if completed == once == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
