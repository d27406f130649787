"""The supervisor: starts node processes, watches them, and decides what a failure means.

A process is down when it exits, does not report READY within `startup_timeout_s`, misses
heartbeats for `deadline_s` (SIGSTOP, a dead machine), or stays inside one call to its node
(`process`, `generate`, `join`, a weight sync) for longer than `process_timeout_s` — its heartbeat
thread says so even while the call blocks. Then its node's `on_failure` policy decides: `restart`
(a budget per replica, with exponential backoff) or `fail`. A process that fails with the same
error at the same ticket as its previous incarnation fails the run at once: that is a bug in the
node, and restarting it again would only burn the budget.

    sup = Supervisor(launcher, run_dir, graph.supervision, policies)
    sup.launch(proc)
    for proc, why in sup.check():        # each tick
        verdict = sup.on_down(proc, why) # "restart" (scheduled) or a failure message
    for proc in sup.due():               # restarts whose backoff has passed
        ...
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

from flowrl.runtime.launch.launcher import Launcher, describe_exit
from flowrl.runtime.controller.procs import Proc

log = logging.getLogger("flowrl.supervisor")

STACKS_SIGNAL = signal.SIGUSR2
"""Asks a node process to write every thread's Python stack into its log (faulthandler, worker.py):
answered even while its main thread waits in C, in a collective or on a lock."""
STACKS_WAIT_S = 0.2  # what a process gets to write them before it is stopped
MISSED_HEARTBEATS = "missed heartbeats"
"""How the reason of a process found by its heartbeat deadline begins (`Restarts.host_mates` reads it)."""


def last_words(procs) -> None:
    """Before stopping processes that hung or never reported READY: each still running writes its
    threads' stacks into its log (where it waits: a silent hang made readable afterwards)."""
    asked = False
    for proc in procs:
        if proc.handle is not None and proc.handle.poll() is None:
            proc.handle.signal(STACKS_SIGNAL)
            asked = True
    if asked:
        time.sleep(STACKS_WAIT_S)


class Supervisor:
    def __init__(self, launcher: Launcher, run_dir: Path, supervision, policies: dict):
        self.launcher = launcher
        self.run_dir = Path(run_dir)
        self.sup = supervision
        self.policies = policies  # node -> FailurePolicy

    def launch(self, proc: Proc) -> None:
        path = self.run_dir / "procs" / f"{proc.spec.log_name}.json"
        proc.spec.write(path)
        proc.ready = proc.wired = False
        proc.error = None
        proc.busy = None
        if proc.handle is not None:  # the last incarnation's: what the launcher still holds for it goes first
            proc.handle.release()
        proc.handle = self.launcher.start(path, self.log_path(proc))
        proc.pid = proc.handle.pid
        proc.started_at = proc.last_seen = time.monotonic()
        proc.down_since = None
        log.info("started %s pid %s (incarnation %d)", proc.id, proc.pid, proc.spec.incarnation)

    def log_path(self, proc: Proc) -> Path:
        """Its log, in its host's folder (`launcher.host_dirs`; else the run directory)."""
        return Path(proc.spec.home) / "logs" / f"{proc.spec.log_name}.log"

    def check(self, procs, now: float | None = None) -> list[tuple[Proc, str]]:
        """Processes that went down since the last check, with why."""
        now = time.monotonic() if now is None else now
        down = []
        for proc in procs:
            if proc.restart.at is not None or proc.down_since is not None or proc.handle is None:
                continue
            code = proc.handle.poll()
            if code is not None:
                down.append((proc, "failed in setup" if proc.error and proc.error.where == "setup" else "exited"))
            elif not proc.ready and now - proc.started_at > self.sup.startup_timeout_s:
                down.append((proc, f"did not report READY within {self.sup.startup_timeout_s:.0f} s"))
            elif proc.ready and now - proc.last_seen > self.sup.deadline_s:
                down.append((proc, f"{MISSED_HEARTBEATS} for {now - proc.last_seen:.1f} s (deadline "
                                   f"{self.sup.deadline_s} s): hung"))
            elif proc.busy is not None and proc.busy[1] > self.sup.process_timeout_s:
                down.append((proc, f"spent {proc.busy[1]:.1f} s inside one call on {proc.busy[0]} (process_timeout_s "
                                   f"{self.sup.process_timeout_s}): hung"))
        return down

    def on_down(self, proc: Proc, why: str, gone: bool = False) -> str:
        """Stop what is left of the process and apply its policy: returns "restart" or a failure
        message (the run must fail). `gone`: its host left the cluster, so there is nothing to ask
        for its stacks or to wait for (its actor is dropped)."""
        code = proc.handle.poll() if proc.handle else None
        if code is None and proc.handle and gone:
            proc.handle.release()
        elif code is None and proc.handle:  # hung, or never ready: its stacks say where
            last_words([proc])
            proc.handle.stop(0.5)  # gone before a replacement binds its address
            code = proc.handle.poll()
        exit_text = "its host is gone" if gone and code is None else describe_exit(code)
        proc.ready = proc.wired = False
        proc.down_since = time.monotonic()
        proc.busy = None
        policy = self.policies[proc.spec.node]
        signature = proc.error.signature() if proc.error else None
        if signature is not None and signature == proc.restart.signature:
            return (f"{why} ({exit_text}) with the same error at the same ticket as its previous incarnation: "
                    "a deterministic bug in the node, so it is not restarted again")
        proc.restart.signature = signature
        if policy.policy == "fail":
            return f"{why} ({exit_text}); its failure policy is `fail`"
        if proc.restart.count >= policy.max_restarts:
            return (f"{why} ({exit_text}) and has used its restart budget of {policy.max_restarts}; "
                    f"raise nodes.{proc.spec.node}.on_failure.max_restarts or fix the node")
        proc.restart.count += 1
        proc.restart.at = time.monotonic() + policy.backoff_s * (2 ** (proc.restart.count - 1))
        log.warning("%s %s (%s); restart %d/%d", proc.id, why, exit_text, proc.restart.count, policy.max_restarts)
        return "restart"

    def due(self, procs, now: float | None = None) -> list[Proc]:
        now = time.monotonic() if now is None else now
        out = [p for p in procs if p.restart.at is not None and now >= p.restart.at]
        for p in out:
            p.restart.at = None
        return out

    def describe(self, proc: Proc, why: str) -> str:
        """The failure text of the run: node, replica, rank, pid, why, the node's error, its log."""
        detail = f"\n  last error: {proc.error.line()}" if proc.error else ""
        log_path = self.log_path(proc)
        where = f" on host {proc.spec.host}" if proc.spec.own_dir else ""
        return (f"node {proc.spec.node!r} replica {proc.spec.replica} rank {proc.spec.rank} (pid {proc.pid}) "
                f"{why}{detail}\n  last log lines ({log_path}{where}):\n"
                + "\n".join("    " + line for line in proc.log_tail(self.run_dir).splitlines()))

    def stop_all(self, procs, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(p.alive for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in procs:
            if proc.handle:
                proc.handle.stop(1.0)
