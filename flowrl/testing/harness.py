"""Run a graph for real — the `flowrl run` command in a child process — and hand back what it left.

    result = run_graph("graphs/grpo.yaml", tmp_path / "run", overrides=["schedule.steps=6"],
                       faults=["kill:rollout@step=2"], timeout_s=120)
    assert result.exit_code == 0
    assert result.audit().exactly_once

Everything the run started is gone when this returns: the run gets its own process group, which
is SIGKILLed (by its id, the child's PID) if it outlives its timeout or the call fails. A run that
outlives its timeout is first asked where each node process waits (`hang_signature`: `flowrl
status --dump`), and the answer ends the result's stderr, so a test that fails on a hang says where.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
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
        try:  # before the kill: what each node process waits on, into its log
            hang = hang_signature(run_dir)
        except Exception as e:  # noqa: BLE001 - the kill below must happen whatever the dump does
            hang = [f"(no dump: {type(e).__name__}: {e})"]
        kill_group(proc.pid)
        out, err = proc.communicate()
        err += f"\n[flowrl.testing] killed after {timeout_s} s; each process then (all of it in {run_dir.name}.hang.txt):"
        err += "".join(f"\n  {line}" for line in hang)
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


def hang_signature(run_dir: Path, wait_s: float = 3.0) -> list[str]:
    """Ask every live node process of the run to write what it waits on into its log (`flowrl
    status --dump`); one line per process: its state, where its main loop waits and what its compute
    thread runs (`in collective all_gather: ...`), or `silent` (its event loop did not answer:
    blocked inside a call). The dumps go to `RUN.hang.txt`."""
    from flowrl.runtime.launch.dump import dump_processes

    run_dir = Path(run_dir)
    logs = run_dir / "logs"
    procs = sorted(p.stem for p in (run_dir / "procs").glob("*.pid"))
    before = {p: (logs / f"{p}.log").stat().st_size if (logs / f"{p}.log").exists() else 0 for p in procs}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            dump_processes(run_dir)
        except Exception:  # noqa: BLE001 - a dump that fails leaves every process silent
            pass
    deadline = time.monotonic() + wait_s
    dumps: dict[str, str] = {}
    while time.monotonic() < deadline and len(dumps) < len(procs):
        time.sleep(0.2)  # the processes write their dumps in their own time
        for p in procs:
            if p in dumps:
                continue
            with contextlib.suppress(OSError):
                with open(logs / f"{p}.log", "rb") as f:
                    f.seek(before[p])
                    text = f.read().decode(errors="replace")
                if "state dump of" in text and "  task " in text:
                    dumps[p] = text[text.index("state dump of"):]
    lines, full = [], []
    for p in procs:
        proc_id = p.replace(".", "/")
        text = dumps.get(p)
        if text is None:
            lines.append(f"{proc_id}: silent (its event loop did not answer the dump: blocked inside a call)")
            continue
        full.append(text)
        head = text.splitlines()[0]
        state = head.split(": ", 1)[1] if ": " in head else head
        main = next((ln.split(": ", 1)[1] for ln in text.splitlines() if ln.startswith("  task ") and "main_loop" in ln), "")
        compute = next((ln.split(": ", 1)[1] for ln in text.splitlines() if ln.startswith("  compute thread: ")), None)
        line = f"{proc_id}: {state}; main loop {_where(main)}"
        if compute is not None:  # where the node's own code runs (a runtime with a compute thread)
            line += f"; compute thread {' <- '.join(compute.split(' <- ')[:3])}"
        lines.append(line)
    run_dir.with_name(run_dir.name + ".hang.txt").write_text("\n".join(lines) + "\n\n" + "\n\n".join(full))
    return lines


LIBRARY_FRAMES = ("_asyncio.py", "locks.py", "memory.py", "tasks.py", "_eventloop.py", "_tasks.py", "queues.py")


def _where(chain: str) -> str:
    """`a (worker.py:1) -> b (datapath.py:2) -> receive (memory.py:3) -> ...` -> where the main loop
    is, in the runtime's and the node's frames: `idle` when it waits for the next event."""
    frames = [f for f in chain.split(" -> ") if " (" in f]
    names = [f.split(" (")[0] for f in frames]
    if "main_loop" not in names:
        return "not found in the dump"
    ours = [f for f in frames[names.index("main_loop"):] if not f.split(" (")[1].startswith(LIBRARY_FRAMES)]
    if len(ours) == 1:
        return "idle (waiting for the next event)"
    return "in " + " > ".join(f.split(" (")[0] for f in ours[1:])
