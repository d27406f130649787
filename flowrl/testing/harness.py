"""Run a graph for real — the `flowrl run` command in a child process — and hand back what it left.

    result = run_graph("graphs/grpo.yaml", tmp_path / "run", overrides=["schedule.steps=6"],
                       faults=["kill:rollout@step=2"], timeout_s=120)
    assert result.exit_code == 0
    assert result.audit().exactly_once

Everything the run started is gone when this returns: the run gets its own process group, which
is SIGKILLed (by its id, the child's PID) if it outlives its timeout or the call fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from flowrl.runtime.api import RunSummary
from flowrl.runtime.protocol.ledger import Audit, audit_ledger, read_jsonl  # noqa: F401  (re-exported by flowrl.testing)


@dataclass
class RunResult(RunSummary):
    """A finished `flowrl run` child: its run directory's files plus what it printed."""

    stdout: str = ""
    stderr: str = ""

    def audit(self, sinks: list[str] | None = None) -> Audit:
        """Exactly-once per ticket and per sink node (`sinks`: default, every sink that consumed)."""
        return audit_ledger(self.ledger, sinks)

    def log(self, name: str) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def flowrl_command(graph: str | Path | None, run_dir: Path, *, overrides=(), faults=(), extra=()) -> list[str]:
    cmd = [sys.executable, "-m", "flowrl", "run"]
    if graph is not None:
        cmd.append(str(graph))
    cmd += [*overrides, "--run-dir", str(run_dir), "--quiet"]
    for f in faults:
        cmd += ["--fault", f]
    return cmd + list(extra)


def run_graph(graph: str | Path | None, run_dir: Path, *, overrides=(), faults=(), extra=(),
              timeout_s: float = 120.0, cwd: Path | None = None, env: dict | None = None) -> RunResult:
    """Run `flowrl run` to completion (or kill it at `timeout_s`) and collect its run directory."""
    run_dir = Path(run_dir)
    cmd = flowrl_command(graph, run_dir, overrides=overrides, faults=faults, extra=extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, err = proc.communicate()
        err += f"\n[flowrl.testing] killed after {timeout_s} s"
        return RunResult(-9, run_dir, out, err)
    finally:
        if proc.poll() is None:
            kill_group(proc.pid)
            proc.wait()
    return RunResult(proc.returncode, run_dir, out, err)


def kill_controller_after_checkpoint(graph: str | Path | None, run_dir: Path, step: int, *, overrides=(),
                                     timeout_s: float = 120.0) -> int:
    """Start `flowrl run`, wait until a checkpoint at ticket `step` or later is committed, then
    SIGKILL the controller (its node processes notice and exit; its process group goes too).
    Returns the step committed last, for `--resume RUN_DIR` to continue from."""
    import json
    import time

    run_dir = Path(run_dir)
    proc = subprocess.Popen(flowrl_command(graph, run_dir, overrides=overrides), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    latest = run_dir / "checkpoints" / "latest.json"
    try:
        deadline = time.monotonic() + timeout_s
        while not (latest.exists() and json.loads(latest.read_text())["step"] >= step):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"no checkpoint at {step} within {timeout_s} s (exit {proc.poll()}): "
                                     f"{proc.stderr.read1().decode(errors='replace')[-2000:]}")
            time.sleep(0.05)  # polling progress on disk, not ordering events
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        kill_group(proc.pid)
        proc.wait()
    return json.loads(latest.read_text())["step"]


def kill_group(pgid: int) -> None:
    """SIGKILL a process group this harness created (its id is the child's PID)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of `pid` (for tests asserting nothing is left)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True) if p.is_running()]
    except psutil.NoSuchProcess:
        return []
