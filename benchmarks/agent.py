"""Agents against rollouts: episodes/s and rollout busy for 1, 2 and 4 agent replicas x 1 and 2
rollout replicas, each cell one real `flowrl run`.

    python benchmarks/agent.py                       # 6 cells x 10 tickets (a few minutes)
    python benchmarks/agent.py --agents 1,2 --rollouts 1 --steps 6
    python benchmarks/agent.py --env-step-s 0.05 --json out.json

Each cell runs `agent (replicas A) -> sink` with `services: [agent -> rollout]` (replicas R), the
built-in `calc` tool task (multi-turn: a tool call, its answer, the final answer) on a small
built-in model with a continuous engine, and no trainer (a frozen policy: what is measured is the
rollout side). Every environment step also waits `--env-step-s` seconds off the CPU (what a
sandbox, a remote tool or a game server costs an agent), so an agent replica spends part of each
episode waiting for its environment, not its rollout.

Columns, over the tickets after the first `--warmup`, from the run's own metrics.jsonl:

  episodes/s     episodes finished / wall seconds
  rollout busy   share of wall time the rollouts are serving at least one request (`compute`
                 spans), mean over replicas and rows
  req p50 / p95  request latency seen by the agents (`service_latency_s`), ms
  queue          requests in flight at the rollouts (`service_queue`), mean over the rows

What to expect: with one rollout, rollout busy rises with agent replicas until the rollout is the
bottleneck (its busy share nears 100% and episodes/s stops rising); a second rollout replica then
lifts episodes/s where the machine has cores for it. On the 2-core development machine every
process shares two cores, so the cells with many processes measure contention too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowrl.agents.envs import CalcEnv  # noqa: E402


class SlowCalc(CalcEnv):
    """`calc` whose every environment step (and tool answer) also waits `step_s` off the CPU."""

    def __init__(self, step_s: float = 0.02, **kw):
        super().__init__(**kw)
        self.step_s = step_s

    def reset(self, task):
        time.sleep(self.step_s)
        return super().reset(task)

    def step(self, text):
        time.sleep(self.step_s)
        return super().step(text)


def graph_text(agents: int, rollouts: int, steps: int, batch: int, samples: int, env_step_s: float) -> str:
    return f"""\
name: agent-bench
vars:
  model: &model {{type: tiny, vocab_size: 102, d_model: 128, n_layers: 2, n_heads: 4, max_seq_len: 96}}
nodes:
  agent:
    kind: agent
    replicas: {agents}
    config:
      env: "benchmarks.agent:SlowCalc"
      env_config: {{step_s: {env_step_s}}}
      model: *model
      samples_per_prompt: {samples}
      max_turns: 3
      max_tokens: 80
      max_new_tokens: 12
  rollout:
    kind: rollout
    replicas: {rollouts}
    config: {{model: *model, engine: {{type: builtin, continuous: true}}}}
  sink: {{kind: "flowrl.testing.nodes:Logger"}}
edges: [agent -> sink]
services: [agent -> rollout]
schedule: {{steps: {steps}, batch_size: {batch}, max_staleness: {2 * agents}}}
"""


def run_cell(agents: int, rollouts: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="flowrl-agent-bench-") as tmp:
        path = Path(tmp) / "graph.yaml"
        path.write_text(graph_text(agents, rollouts, args.steps, args.batch, args.samples, args.env_step_s))
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "flowrl", "run", str(path), "--run-dir", str(run_dir), "--quiet"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"agents": agents, "rollouts": rollouts, "error": f"timed out after {args.timeout} s"}
        if proc.returncode != 0:
            return {"agents": agents, "rollouts": rollouts, "error": (err or out).strip().splitlines()[-1:]}
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = sorted(rows, key=lambda r: r["step"])
    warm = rows[min(args.warmup, len(rows) - 2)]
    last = rows[-1]
    episodes = sum(r.get("episodes", 0) for r in rows if r["step"] > warm["step"])
    wall = last["wall_s"] - warm["wall_s"]
    busy = [r["rollout/compute_ratio"] for r in rows[args.warmup:] if r.get("rollout/compute_ratio") is not None]
    queue = [r["service_queue"] for r in rows[args.warmup:] if r.get("service_queue") is not None]
    return {"agents": agents, "rollouts": rollouts, "episodes_per_s": episodes / wall if wall > 0 else 0.0,
            "rollout_busy": sum(busy) / len(busy) if busy else None,
            "p50_ms": 1000 * last.get("service_latency_s_p50", 0.0), "p95_ms": 1000 * last.get("service_latency_s_p95", 0.0),
            "queue": sum(queue) / len(queue) if queue else None, "episodes": episodes, "wall_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", default="1,2,4")
    ap.add_argument("--rollouts", default="1,2")
    ap.add_argument("--steps", type=int, default=30, help="tickets per cell")
    ap.add_argument("--batch", type=int, default=8, help="tasks per ticket")
    ap.add_argument("--samples", type=int, default=8, help="episodes per task")
    ap.add_argument("--env-step-s", type=float, default=0.02)
    ap.add_argument("--warmup", type=int, default=5, help="tickets left out (start-up)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    cells = [run_cell(a, r, args) for r in map(int, args.rollouts.split(",")) for a in map(int, args.agents.split(","))]
    print(f"\nagents x rollouts, calc task, {args.batch} tasks x {args.samples} episodes per ticket, "
          f"env step {1000 * args.env_step_s:.0f} ms, {args.steps} tickets (first {args.warmup} left out)\n")
    print(f"{'agents':>6} {'rollouts':>8} {'episodes/s':>11} {'rollout busy':>13} {'req p50 ms':>11} "
          f"{'req p95 ms':>11} {'queue':>6}")
    for c in cells:
        if "error" in c:
            print(f"{c['agents']:>6} {c['rollouts']:>8}  failed: {c['error']}")
            continue
        busy = f"{100 * c['rollout_busy']:.0f}%" if c["rollout_busy"] is not None else "-"
        queue = f"{c['queue']:.1f}" if c["queue"] is not None else "-"
        print(f"{c['agents']:>6} {c['rollouts']:>8} {c['episodes_per_s']:>11.1f} {busy:>13} {c['p50_ms']:>11.1f} "
              f"{c['p95_ms']:>11.1f} {queue:>6}")
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))
    return 0 if all("error" not in c for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
