"""Weight sync under elastic chaos: random sequences of `flowrl scale` up/down and kill -9 of
rollout replicas while a run goes on; every run must finish, every ticket exactly once, within a
bound after the last move.

    python benchmarks/scale_sequences.py               # seeds 0..19
    python benchmarks/scale_sequences.py --seeds 3 --steps 80

The graph is numbers -> rollout (a weight subscriber) -> trainer (the publisher), synchronous
(max_staleness 0), so a weight sync that waits for a replica that is gone stalls the run
(flowrl/testing/elastic.py). Ops: `=N` scale to N replicas, `xR` kill -9 replica R; `/p` then wait
for two more completed tickets, `/s` for the new replicas' first weight sync, `/d` for the
controller to notice the kill; none: the next op races it. CI plays two of these seeds
(tests/runtime/test_scale_weights.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.testing.elastic import run_sequence  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20, help="play seeds 0..N-1")
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--bound-s", type=float, default=120.0, help="the run must end this long after the last op")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="flowrl-scale-seq-"))
    print(f"{args.seeds} sequences, {args.steps} tickets each, bound {args.bound_s:.0f} s after the last op "
          f"(run dirs in {root})")
    head = f"{'seed':>4}  {'ops':<34} {'played':>6} {'exit':>4} {'once':>5} {'tickets':>7} {'scaled':>6} " \
           f"{'down':>4} {'reiss':>5} {'run s':>6} {'end s':>6}"
    print(head)
    rows, t0 = [], time.monotonic()
    for seed in range(args.first, args.first + args.seeds):
        r = run_sequence(seed, root / f"seed-{seed}", steps=args.steps, bound_s=args.bound_s)
        rows.append(r)
        ops = " ".join(map(str, r.ops))
        print(f"{seed:>4}  {ops:<34} {r.played:>3}/{len(r.ops):<2} {r.exit_code:>4} {str(r.exactly_once):>5} "
              f"{r.issued:>7} {r.scaled:>6} {r.downs:>4} {r.reissued:>5} {r.seconds:>6.1f} {r.after_last_op_s:>6.1f}"
              + (f"  ERROR {r.error}" if r.error else ""), flush=True)
    ok = sum(r.ok for r in rows)
    print(f"{ok}/{len(rows)} finished exactly once within the bound; {time.monotonic() - t0:.0f} s in all; "
          f"slowest end after the last op {max(r.after_last_op_s for r in rows):.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(r), "ops": [str(o) for o in r.ops]} for r in rows], indent=1))
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
