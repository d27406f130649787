"""Randomised chaos: kill -9 a random node at a random time in short GRPO runs, audit every ledger.

    python benchmarks/chaos.py --trials 20            # prints the table
    python benchmarks/chaos.py --trials 3 --json out.json

Each trial runs `graphs/grpo.yaml` (a small, quick variant: 4 digits, 1 layer) for real with
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
NODES = ["prompts", "rollout", "reward", "reference", "advantages", "actor"]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="flowrl-chaos-") as d:
        for i in range(args.trials):
            row = trial(i, rng, Path(d))
            rows.append(row)
            rec = f"{row['recovery_s']:.2f}" if row["recovery_s"] is not None else "-"
            print(f"trial {i:>2}  {row['fault']:<26} exit {row['exit_code']:>3}  killed {str(row['killed']):<5} "
                  f"exactly-once {str(row['exactly_once']):<5} recovery {rec:>6} s", flush=True)
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
