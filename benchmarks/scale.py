"""Replicas and elastic scaling, measured: throughput against the ideal, and `flowrl scale` mid-run.

    python benchmarks/scale.py            # (a) 1, 2, 4, 8 replicas; (b) elastic 1 -> 3 -> 1
    python benchmarks/scale.py --quick    # a short smoke run

(a) A source feeds a sleep-bound stage (each batch sleeps `--stage-s`) with R replicas; the ideal
is R / stage_s batches per second. (b) The same stage at 1 replica, scaled to 3 while the run goes
on: seconds from the command to the new replicas' first batch (from their logs), throughput before
and after, then scaled back to 1 with no ticket lost (the ledger's audit).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.testing import audit_ledger, read_jsonl  # noqa: E402
from flowrl.testing.harness import flowrl_command, kill_group  # noqa: E402

N = "flowrl.testing.nodes"


def graph(replicas: int, stage_s: float, steps: int, k: int) -> str:
    return f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  stage: {{kind: "{N}:Scale", replicas: {replicas}, config: {{delay_s: {stage_s}}}}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> stage, stage -> collect]
schedule: {{steps: {steps}, batch_size: 2, max_staleness: {k}, checkpoint_every: 0}}
supervision: {{heartbeat_s: 0.2, deadline_s: 5.0}}
"""


def completions(run_dir: Path) -> list[float]:
    return sorted(r["t"] for r in read_jsonl(run_dir / "ledger.jsonl") if r["event"] == "completed")


def rate(times: list[float], lo: float, hi: float) -> float:
    inside = [t for t in times if lo <= t <= hi]
    return (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 2 else float("nan")


def steady_rate(run_dir: Path) -> float:
    t = completions(run_dir)
    skip = max(2, len(t) // 5)  # the first steps include the start-up
    return (len(t) - 1 - skip) / (t[-1] - t[skip])


def replicas_case(root: Path, replicas: int, stage_s: float, steps: int) -> dict:
    d = root / f"r{replicas}"
    d.mkdir()
    (d / "g.yaml").write_text(graph(replicas, stage_s, steps, k=2 * replicas + 2))
    out = subprocess.run(flowrl_command(d / "g.yaml", d / "run"), capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    measured = steady_rate(d / "run")
    ideal = replicas / stage_s
    return {"replicas": replicas, "measured": measured, "ideal": ideal, "ratio": measured / ideal}


def scale(run_dir: Path, change: str) -> None:
    out = subprocess.run([sys.executable, "-m", "flowrl", "scale", str(run_dir), change], capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        raise SystemExit(f"flowrl scale {change} failed: {out.stderr}")


def elastic_case(root: Path, stage_s: float, steps: int) -> dict:
    d = root / "elastic"
    d.mkdir()
    (d / "g.yaml").write_text(graph(1, stage_s, steps, k=8))
    run_dir = d / "run"
    proc = subprocess.Popen(flowrl_command(d / "g.yaml", run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        while len(completions(run_dir)) < steps // 6:
            time.sleep(0.1)
        t_cmd = time.time()
        scale(run_dir, "stage=3")
        firsts = []
        for r in (1, 2):
            log = run_dir / "logs" / f"stage.{r}.0.log"
            while not (log.exists() and "first batch" in log.read_text()):
                time.sleep(0.05)
            firsts.append(float(re.search(r"first batch .* \(at ([0-9.]+)\)", log.read_text()).group(1)))
        t_up = max(firsts)
        while len(completions(run_dir)) < steps // 2:
            time.sleep(0.1)
        t_down = time.time()
        scale(run_dir, "stage=1")
        _, err = proc.communicate(timeout=600)
    finally:
        kill_group(proc.pid)
        proc.wait()
    if proc.returncode != 0:
        raise SystemExit(err[-2000:])
    times = completions(run_dir)
    audit = audit_ledger(read_jsonl(run_dir / "ledger.jsonl"), ["collect"])
    return {"to_first_batch_s": t_up - t_cmd, "before_per_s": rate(times, times[0], t_cmd),
            "after_per_s": rate(times, t_up, t_down), "exactly_once": audit.exactly_once,
            "steps": len(audit.issued)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and replicas (a smoke run)")
    ap.add_argument("--stage-s", type=float, default=0.2)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    counts = (1, 2) if args.quick else (1, 2, 4, 8)
    root = Path(tempfile.mkdtemp(prefix="flowrl-scale-"))
    rows = [replicas_case(root, r, args.stage_s, (20 if args.quick else 40) * r) for r in counts]
    print(f"(a) replicas of a {args.stage_s * 1000:.0f} ms stage ({Path(sys.executable).name}, run dirs in {root})")
    print(f"{'replicas':>8} {'measured /s':>12} {'ideal /s':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['replicas']:>8} {r['measured']:>12.2f} {r['ideal']:>9.2f} {r['ratio']:>6.2f}")
    el = elastic_case(root, args.stage_s, 100 if args.quick else 200)
    print("\n(b) elastic: 1 replica -> 3 (flowrl scale) -> 1")
    print(f"  command to the new replicas' first batch: {el['to_first_batch_s']:.2f} s (target <= 3 s)")
    print(f"  throughput before: {el['before_per_s']:.2f} /s, with 3 replicas: {el['after_per_s']:.2f} /s")
    print(f"  scaled back to 1: {el['steps']} tickets, exactly once: {el['exactly_once']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"replicas": rows, "elastic": el}, indent=1))
    return 0 if el["exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
