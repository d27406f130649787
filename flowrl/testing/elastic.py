"""Elastic runs under fire: a weight-subscribing `rollout` scaled up and down, and killed, while a
run goes on — the trainer's weight sync must follow the replicas that exist.

    with ElasticRun(tmp_path) as run:              # `flowrl run` in a child process (its own group)
        run.wait_completed(5)
        run.scale(3)
        run.wait_synced(1, 2)                      # replicas 1 and 2 took a weight version
        run.kill(1)                                # kill -9, by the PID its pid file names
        run.wait_down(1)                           # the controller noticed (ledger `node_down`)
        run.scale(1)
        result = run.finish(timeout_s=90)          # RunResult; killed (exit -9) past the bound
    assert result.exit_code == 0 and result.audit(["trainer"]).exactly_once

Every step is ordered by what the run wrote (ledger rows, pid files), never by sleeping: the
`wait_*` helpers poll those files. `random_ops(seed)` draws a sequence of scale and kill steps,
each followed by what to wait for before the next (progress, the kill noticed, or nothing: the
next step races it); `run_sequence(seed, root)` plays one and returns a row for a table
(benchmarks/scale_sequences.py, tests/runtime/test_scale_weights.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flowrl.runtime.protocol.ledger import read_jsonl
from flowrl.testing.harness import RunResult, flowrl_command, kill_group

N = "flowrl.testing.nodes"
ROOT = Path(__file__).resolve().parents[2]  # the checkout this flowrl is imported from
NODE = "rollout"


def graph_text(steps: int, delay_s: float = 0.04) -> str:
    """numbers -> rollout (weight subscriber) -> trainer (publisher, a stateful sink), synchronous
    (max_staleness 0: every ticket needs the version before it, so a stuck sync stalls the run)."""
    return f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  {NODE}: {{kind: "{N}:Follower", config: {{delay_s: {delay_s}}}, on_failure: {{max_restarts: 8}}}}
  trainer: {{kind: "{N}:Trainer", config: {{delay_s: 0.01}}}}
edges: [numbers -> {NODE}, {NODE} -> trainer]
weights: [trainer -> {NODE}]
schedule: {{steps: {steps}, batch_size: 2, max_staleness: 0, checkpoint_every: 20}}
supervision: {{heartbeat_s: 0.2, deadline_s: 3.0}}
"""


class RunEnded(Exception):
    """The run ended while a move or a wait was still to come (a sequence longer than the run)."""


class ElasticRun:
    """`flowrl run` of `graph_text` in a child process, with the moves of an operator."""

    def __init__(self, root: Path, *, steps: int = 60, delay_s: float = 0.04):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.run_dir = self.root / "run"
        self.steps = steps
        (self.root / "g.yaml").write_text(graph_text(steps, delay_s))
        self.proc: subprocess.Popen | None = None
        self.killed: list[int] = []
        self.downs_before: dict[str, int] = {}  # process -> its node_down rows when we killed it
        self.t0 = time.monotonic()

    def env(self) -> dict:
        path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        return {**os.environ, "PYTHONPATH": path, "FLOWRL_WEIGHT_DIGEST": "1"}  # a `weights` row per sync

    def __enter__(self) -> "ElasticRun":
        self.out = open(self.root / "stdout.txt", "w")
        self.err = open(self.root / "stderr.txt", "w")
        self.proc = subprocess.Popen(flowrl_command(self.root / "g.yaml", self.run_dir), cwd=ROOT, env=self.env(),
                                     stdout=self.out, stderr=self.err, start_new_session=True)
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid)  # whatever is left: the run's own process group, by its id
            self.proc.wait()
        self.out.close()
        self.err.close()

    # what the run wrote -----------------------------------------------------------------------
    def ledger(self) -> list[dict]:
        return read_jsonl(self.run_dir / "ledger.jsonl")

    def completed(self) -> int:
        return sum(1 for r in self.ledger() if r["event"] == "completed")

    def wait_for(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None:
                raise RunEnded(f"the run ended (exit {self.proc.returncode}) while waiting for {what}")
            time.sleep(0.05)  # polling the run's files for a state, not ordering events by time
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def stderr(self) -> str:
        self.err.flush()
        return (self.root / "stderr.txt").read_text(errors="replace")

    def wait_completed(self, n: int, timeout_s: float = 90) -> None:
        self.wait_for(lambda: self.completed() >= n, timeout_s, f"{n} completed tickets")

    def wait_progress(self, more: int = 2, timeout_s: float = 90) -> None:
        n = self.completed() + more
        self.wait_for(lambda: self.completed() >= n or self.completed() >= self.steps, timeout_s,
                      f"{more} more completed tickets")

    def wait_synced(self, *replicas: int, timeout_s: float = 60) -> None:
        """Each of `replicas` took a weight version after now (a `weights` row from it)."""
        start = len(self.ledger())
        ids = {f"{NODE}/{r}/0" for r in replicas}
        self.wait_for(lambda: ids <= {r.get("node") for r in self.ledger()[start:] if r["event"] == "weights"},
                      timeout_s, f"a weight sync of {sorted(ids)}")

    def wait_down(self, replica: int, timeout_s: float = 30) -> None:
        """The controller noticed the kill of `replica` (its `node_down` row)."""
        proc_id = f"{NODE}/{replica}/0"
        before = self.downs_before.get(proc_id, 0)
        self.wait_for(lambda: self.count_down(proc_id) > before, timeout_s, f"node_down of {proc_id}")

    def count_down(self, proc_id: str) -> int:
        return sum(1 for r in self.ledger() if r["event"] == "node_down" and r.get("node") == proc_id)

    # an operator's moves ---------------------------------------------------------------------
    def scale(self, replicas: int) -> str:
        out = subprocess.run([sys.executable, "-m", "flowrl", "scale", str(self.run_dir), f"{NODE}={replicas}"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT, env=self.env())
        if out.returncode != 0:
            if self.proc.poll() is not None:
                raise RunEnded(f"the run ended (exit {self.proc.returncode}) before flowrl scale {NODE}={replicas}")
            raise AssertionError(f"flowrl scale {NODE}={replicas} failed: {out.stderr.strip()}")
        return out.stdout.strip()

    def pid_of(self, replica: int) -> int | None:
        """The live process of `replica`, from its pid file, if it is one of this run's (its process
        group is the run's: pids are reused, and only what we started may be killed)."""
        try:
            pid = int(json.loads((self.run_dir / "procs" / f"{NODE}.{replica}.0.pid").read_text())["pid"])
            if pid in self.killed or os.getpgid(pid) != self.proc.pid:
                return None
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return None
        except (OSError, ValueError, KeyError):
            return None
        return pid

    def kill(self, replica: int, timeout_s: float = 60) -> int:
        """kill -9 the process of `replica` (waiting for one we did not kill yet: it may be starting)."""
        self.wait_for(lambda: self.pid_of(replica) is not None, timeout_s, f"a live process of {NODE}/{replica}")
        pid = self.pid_of(replica)
        self.downs_before[f"{NODE}/{replica}/0"] = self.count_down(f"{NODE}/{replica}/0")
        os.kill(pid, signal.SIGKILL)
        self.killed.append(pid)
        return pid

    def finish(self, timeout_s: float) -> RunResult:
        """The run's end within `timeout_s`, or the run is killed and the result says -9."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            self.proc.wait()
            return RunResult(-9, self.run_dir, "", self.stderr() + f"\n[elastic] killed: not finished within {timeout_s} s")
        return RunResult(code, self.run_dir, "", self.stderr())


# random sequences --------------------------------------------------------------------------------
@dataclass
class Op:
    kind: str  # "scale" | "kill"
    arg: int  # replicas, or the replica to kill
    then: str  # what to wait for before the next op: "progress" | "down" | "synced" | "now"

    def __str__(self) -> str:
        return f"{'x' if self.kind == 'kill' else '='}{self.arg}{'' if self.then == 'now' else '/' + self.then[0]}"


def random_ops(seed: int, n_ops: int | None = None, max_replicas: int = 3) -> list[Op]:
    """A sequence of scale-ups, scale-downs and kills of `rollout`; after each, what the next waits
    for. Kills hit any replica there is (old or new), at most three per sequence (restart budgets)."""
    rng = random.Random(seed)
    ops, replicas, kills = [], 1, 0
    for _ in range(n_ops or rng.randint(4, 7)):
        if kills < 3 and rng.random() < 0.4:
            ops.append(Op("kill", rng.randrange(replicas), rng.choice(["down", "now", "progress"])))
            kills += 1
            continue
        n = rng.choice([r for r in range(1, max_replicas + 1) if r != replicas])
        then = rng.choice(["now", "progress", "synced"] if n > replicas else ["now", "progress"])
        ops.append(Op("scale", n, then))
        replicas = n
    if replicas > 1:
        ops.append(Op("scale", 1, rng.choice(["now", "progress"])))  # end on a scale-down: the case that hung
    return ops


@dataclass
class SequenceResult:
    seed: int
    ops: list[Op]
    exit_code: int = 0
    exactly_once: bool = False
    played: int = 0  # ops played before the run reached its end
    issued: int = 0
    scaled: int = 0
    downs: int = 0
    reissued: int = 0
    seconds: float = 0.0
    after_last_op_s: float = 0.0
    error: str = ""
    run_dir: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.exactly_once and not self.error


def run_sequence(seed: int, root: Path, *, steps: int = 80, bound_s: float = 120.0) -> SequenceResult:
    """Play `random_ops(seed)` on a fresh run; it must then finish, every ticket exactly once,
    within `bound_s` of the last op."""
    ops = random_ops(seed)
    res = SequenceResult(seed, ops, run_dir=str(Path(root) / "run"))
    t0 = time.monotonic()
    with ElasticRun(root, steps=steps) as run:
        try:
            run.wait_completed(3)
            replicas = 1
            for op in ops:
                if run.completed() >= steps:
                    break  # the run is over: the rest of the sequence has nothing to act on
                if op.kind == "scale":
                    before = replicas
                    run.scale(op.arg)
                    replicas = op.arg
                    if op.then == "synced" and op.arg > before:
                        run.wait_synced(*range(before, op.arg))
                else:
                    run.kill(op.arg)
                    if op.then == "down":
                        run.wait_down(op.arg)
                res.played += 1
                if op.then == "progress":
                    run.wait_progress(2)
        except RunEnded:
            pass  # the run reached its end before the sequence did: what was played is counted
        except AssertionError as e:
            res.error = str(e)[:500]
        if not res.error:
            t_last = time.monotonic()
            result = run.finish(bound_s)
            res.after_last_op_s = time.monotonic() - t_last
        else:  # a move failed or a wait timed out: the run is stopped, the row says why
            result = run.finish(1)
    res.seconds = time.monotonic() - t0
    res.exit_code = result.exit_code
    rows = result.ledger
    audit = result.audit(["trainer"])
    res.exactly_once = audit.exactly_once and len(audit.issued) == steps
    res.issued = len(audit.issued)
    res.scaled = sum(1 for r in rows if r["event"] == "scaled")
    res.downs = sum(1 for r in rows if r["event"] == "node_down")
    res.reissued = sum(1 for r in rows if r["event"] == "reissued")
    if result.exit_code != 0 and not res.error:
        res.error = result.stderr.strip().splitlines()[-1][:300] if result.stderr.strip() else "no output"
    return res
