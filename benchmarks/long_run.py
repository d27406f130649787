"""Long run: does the runtime stay flat over a million steps? Controller memory, CPU per step and
run-directory size, sampled at report points while sleep-free synthetic nodes run.

    python benchmarks/long_run.py                          # 1,000,000 steps; reports at 10k, 100k, 1M
    python benchmarks/long_run.py --steps 20000 --report-at 1000 10000 20000     # a smoke run
    python benchmarks/long_run.py --steps 200000 --json long.json

The graph is `TicketSource -> Fold (stateful) -> FoldSink (stateful)` from `flowrl.testing.chaos`
(hash-chain states of bounded size, one sample per ticket, `max_staleness` tickets in flight), so
every cost measured is the runtime's own. At each report point (the first time the run's last
metrics row reaches it) it prints:

- steps, wall seconds, steps/s since the previous point;
- controller RSS (MiB), read from the `flowrl run` process with psutil;
- controller CPU per step (us): controller CPU seconds (user + system) / steps, between points;
- node CPU per step (us): the same for every node process together;
- run-directory size (MiB) and its growing parts (ledger, metrics, trace, checkpoints; MiB), and
  the checkpoint files kept.

What the issue asks (#11): RSS flat within 10 %, constant CPU per step, disk bounded by
`schedule.keep_checkpoints`. Exit 0 when the run reached --steps; the verdict lines say the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def graph_yaml(steps: int, checkpoint_every: int, staleness: int, keep: int | None) -> str:
    from flowrl.graph import GraphSpec, dump_graph
    from flowrl.testing.chaos import Features
    from flowrl.testing.chaos.nodes import KINDS

    schedule = {"steps": steps, "batch_size": 1, "max_staleness": staleness, "checkpoint_every": checkpoint_every,
                "ticket_timeout_s": 60}
    if keep is not None and Features.detect().keep_checkpoints:
        schedule["keep_checkpoints"] = keep
    spec = GraphSpec.model_validate({
        "name": "long_run", "seed": 0,
        "nodes": {"src": {"kind": KINDS["TicketSource"]},
                  "fold": {"kind": KINDS["Fold"], "config": {"history": 16}},
                  "sink": {"kind": KINDS["FoldSink"], "config": {"history": 16}}},
        "edges": ["src -> fold", "fold -> sink"],
        "schedule": schedule,
        "supervision": {"heartbeat_s": 0.5, "deadline_s": 10},
    })
    return dump_graph(spec)


def last_step(run_dir: Path) -> int:
    """The step of the last row of metrics.jsonl, read from its tail (O(1), the file grows)."""
    path = run_dir / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


def dir_size(path: Path) -> dict:
    """Bytes under a run directory: total and its growing parts; checkpoint files kept."""
    out = {"total": 0, "checkpoints": 0, "ckpt_files": 0}
    for root, _, files in os.walk(path):
        for name in files:
            try:
                size = os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
            out["total"] += size
            if os.path.basename(root) == "checkpoints":
                out["checkpoints"] += size
                out["ckpt_files"] += name.endswith(".pt")
            elif root == str(path) and name in ("ledger.jsonl", "metrics.jsonl", "trace.json"):
                out[name.split(".")[0]] = size
    return out


def cpu_of(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def main() -> int:
    import psutil

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--report-at", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--checkpoint-every", type=int, default=1000)
    ap.add_argument("--max-staleness", type=int, default=8, help="tickets in flight - 1")
    ap.add_argument("--keep-checkpoints", type=int, default=2, help="passed when the runtime has the knob")
    ap.add_argument("--run-dir", help="keep the run directory here (default: a temporary one)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    points = sorted({p for p in args.report_at if p <= args.steps} | {args.steps})

    tmp = tempfile.TemporaryDirectory(prefix="flowrl-long-")
    run_dir = Path(args.run_dir) if args.run_dir else Path(tmp.name) / "run"
    graph = Path(tmp.name) / "long_run.yaml"
    graph.write_text(graph_yaml(args.steps, args.checkpoint_every, args.max_staleness, args.keep_checkpoints))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "flowrl", "run", str(graph), "--run-dir", str(run_dir), "--quiet"]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env,
                             cwd=ROOT)
    ctl = psutil.Process(child.pid)
    t0 = time.monotonic()
    rows, prev = [], {"step": 0, "wall": 0.0, "ctl_cpu": 0.0, "node_cpu": 0.0}
    print(f"{'steps':>9} {'wall s':>8} {'steps/s':>8} {'ctl RSS MiB':>11} {'ctl CPU us/step':>15} "
          f"{'node CPU us/step':>16} {'run dir MiB':>11} {'ledger':>7} {'metrics':>7} {'trace':>7} {'ckpts':>7} "
          f"{'ckpt files':>10}", flush=True)
    try:
        pending = list(points)
        node_cpu_seen: dict[int, float] = {}
        while pending and child.poll() is None:
            time.sleep(0.2)
            step = last_step(run_dir)
            try:  # node processes come and go (forkserver children); keep the last CPU seen of each
                for p in ctl.children(recursive=True):
                    try:
                        node_cpu_seen[p.pid] = cpu_of(p)
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                break
            if step < pending[0]:
                continue
            while pending and step >= pending[0]:
                pending.pop(0)
            wall = time.monotonic() - t0
            rss = ctl.memory_info().rss / 2**20
            ctl_cpu, node_cpu = cpu_of(ctl), sum(node_cpu_seen.values())
            sizes = dir_size(run_dir)
            mib = {k: round(sizes.get(k, 0) / 2**20, 2) for k in ("total", "ledger", "metrics", "trace", "checkpoints")}
            d = max(1, step - prev["step"])
            row = {"step": step, "wall_s": round(wall, 2), "steps_per_s": round(d / max(1e-9, wall - prev["wall"]), 1),
                   "controller_rss_mib": round(rss, 1),
                   "controller_cpu_us_per_step": round(1e6 * (ctl_cpu - prev["ctl_cpu"]) / d, 1),
                   "node_cpu_us_per_step": round(1e6 * (node_cpu - prev["node_cpu"]) / d, 1),
                   "run_dir_mib": mib["total"], "ledger_mib": mib["ledger"], "metrics_mib": mib["metrics"],
                   "trace_mib": mib["trace"], "checkpoints_mib": mib["checkpoints"],
                   "checkpoint_files": sizes["ckpt_files"]}
            rows.append(row)
            prev = {"step": step, "wall": wall, "ctl_cpu": ctl_cpu, "node_cpu": node_cpu}
            print(f"{step:>9} {wall:>8.1f} {row['steps_per_s']:>8.1f} {rss:>11.1f} "
                  f"{row['controller_cpu_us_per_step']:>15.1f} {row['node_cpu_us_per_step']:>16.1f} "
                  f"{mib['total']:>11.2f} {mib['ledger']:>7.2f} {mib['metrics']:>7.2f} {mib['trace']:>7.2f} "
                  f"{mib['checkpoints']:>7.2f} {sizes['ckpt_files']:>10}", flush=True)
        code = child.wait(timeout=120)
    except KeyboardInterrupt:
        code = 130
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        err = child.stderr.read().decode(errors="replace") if child.stderr else ""
        tmp.cleanup() if not args.run_dir else None
    if code != 0:
        print(f"flowrl run exited {code}:\n{err[-3000:]}", file=sys.stderr)
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        grow = last["controller_rss_mib"] / first["controller_rss_mib"] - 1
        cost = last["controller_cpu_us_per_step"] / max(1e-9, first["controller_cpu_us_per_step"])
        print(f"\ncontroller RSS {first['controller_rss_mib']} -> {last['controller_rss_mib']} MiB ({grow:+.0%}; "
              f"target within 10 %); controller CPU per step x{cost:.2f} from the first to the last point "
              f"(target ~1); run directory {first['run_dir_mib']} -> {last['run_dir_mib']} MiB, "
              f"{last['checkpoint_files']} checkpoint files")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "exit_code": code, "points": rows}, indent=1))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
