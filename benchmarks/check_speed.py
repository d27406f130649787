"""How long `flowrl check` takes: the command from a cold start, hostile files, large hosts.

    python benchmarks/check_speed.py              # each case 3 times; prints the fastest, exits 1 if one is over
    python benchmarks/check_speed.py --repeat 10

The tests check what keeps these fast, as counts that do not depend on the machine: the command
loads nothing heavy and starts no process (tests/test_check_cli.py), the reader's work on a
hostile file is bounded by what the file writes (tests/graph/test_hostile_files.py), the planner's
searches stay within their budgets (tests/placement/test_scale.py). The times are here; the
targets are for an idle machine (docs/placement.md: well under two seconds, also on a 256-GPU host).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cold_check() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "flowrl", "check", "graphs/ppo.yaml"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"flowrl check graphs/ppo.yaml exited {r.returncode}: {r.stderr[-2000:]}")


def cases() -> list[tuple[str, float, object]]:
    """(what, target seconds, a call that does it once)."""
    from flowrl.graph import GraphError, load_graph_text
    from flowrl.placement import make_plan
    from tests.graph.test_hostile_files import BOMB, PIPE
    from tests.placement.conftest import graph, plan_of
    from tests.placement.test_scale import big_host

    def refused(text: str):
        def read():
            try:
                load_graph_text(text, "g.yaml")
            except GraphError:
                return
            raise SystemExit("a hostile file was read without a GraphError")
        return read

    big = graph("  actor: {kind: R:Actor, devices: 64}\n  critic: {kind: R:Critic, devices: 32}\n"
                "  rollout: {kind: R:Rollout, devices: 8, replicas: 16}\n  reference: {kind: R:Reference, devices: 16}")
    pcie = graph("  actor: {kind: R:Actor, devices: 32}\n  critic: {kind: R:Critic, devices: 8}")
    billion = "  rollout: {kind: R:Rollout, devices: 1, replicas: 1000000000}"
    return [
        ("flowrl check graphs/ppo.yaml, a fresh process", 2.0, cold_check),
        ("a 510-byte alias bomb (9^9 strings)", 1.0, refused(BOMB + PIPE)),
        ("5,000 nested flow lists", 2.0, refused("[" * 5000 + "]" * 5000)),
        ("3,000 nested flow mappings", 2.0, refused("a: " + "{b: " * 3000 + "1" + "}" * 3000)),
        ("200 nested block lists", 2.0, refused("a:\n" + "".join("  " * i + "- \n" for i in range(1, 200)))),
        ("a flow list of 400,000 values", 3.0, refused("a: [" + "1," * 400_000 + "1]\n")),
        ("a block list of 200,000 values", 3.0, refused("a:\n" + "- 1\n" * 200_000)),
        ("plan: 256-GPU NVSwitch host, 240 GPUs asked", 2.0, lambda: make_plan(big, big_host(256))),
        ("plan: 72-GPU PCIe host, a 32-GPU actor", 1.0, lambda: make_plan(pcie, big_host(72, nvswitch=False))),
        ("plan: a billion replicas on 256 GPUs", 0.5, lambda: plan_of(billion, big_host(256))),
        ("plan: a billion replicas on 2 CPUs", 0.5, lambda: plan_of(billion, "laptop-2cpu.yaml")),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each case; the fastest counts")
    args = ap.parse_args(argv)
    rows = []
    for what, target, call in cases():
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        rows.append((what, min(times), target))
    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'fastest s':>9}  {'target s':>8}")
    for what, best, target in rows:
        print(f"{what:<{width}}  {best:>9.3f}  {target:>8.1f}{'  OVER' if best > target else ''}")
    over = sum(best > target for _, best, target in rows)
    print(f"\n{over} case(s) over target")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
