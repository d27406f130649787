"""What the run reports while it goes: metrics rows, node up/down gauges, the live view's facts.

The one writer of the metrics hub (and of the summary the live view shows) on the controller's
side; every component that has something to say calls one method here. Without a hub (tests, a
run without metrics) every call is a no-op.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from flowrl.runtime.controller.procs import Proc

log = logging.getLogger("flowrl.controller")
STATUS_EVERY_S = 0.5
"""status.json is rewritten at a step at most this often (the live view also rewrites it every second;
the run's end writes the final one): once per step, it was ~40% of the controller's CPU on graphs/grpo.yaml (~2 ms a step)."""


class RunReport:
    def __init__(self, hub, run_dir: Path, summary: dict | None = None, on_tick=None):
        self.hub = hub
        self.run_dir = run_dir
        self.summary = summary
        self.on_tick = on_tick  # the live view's refresh, once per control-loop tick
        self.last_row: dict | None = None  # the last step's row, written once the nodes have stopped
        self.update_staleness = None  # the largest staleness among the tickets of the update under way
        self.status_at = float("-inf")  # when `step` last rewrote status.json (monotonic)

    def node_up(self, proc: Proc, up: bool) -> None:
        if self.hub:
            self.hub.set("node_up", int(up), node=proc.spec.node, replica=str(proc.spec.replica), across="min")

    def restarted(self, proc: Proc, why: str) -> None:
        if self.hub:
            self.hub.inc("restarts", node=proc.spec.node, replica=str(proc.spec.replica))
            self.hub.event("restart", node=proc.id, why=why)

    def ingest(self, proc: Proc, metrics: dict | None) -> None:
        if metrics and self.hub:
            try:
                self.hub.ingest(metrics)
            except Exception as e:  # noqa: BLE001 - a bad snapshot is dropped, the run goes on
                log.warning("dropped a metrics snapshot from %s: %s", proc.id, e)

    def ticket(self, completed: int, per_update: int, version: int, staleness, done: bool) -> None:
        """A ticket completed (`completed` so far): an update's row once its last ticket did
        (`per_update` tickets each, `schedule.ticket: group`), with the largest staleness among them."""
        held = self.update_staleness
        self.update_staleness = staleness if held is None else max(held, staleness)
        if completed % per_update == 0 or done:
            self.step(-(-completed // per_update), version, self.update_staleness, done)
            self.update_staleness = None

    def step(self, completed: int, version: int, staleness, done: bool) -> None:
        """A training step completed: its row (the last one waits for the nodes' final metrics)."""
        if not self.hub:
            return
        from flowrl.metrics import write_status

        row = dict(step=completed, policy_version=version, extra={"staleness_max": staleness})
        self.write_last_row()  # one deferred before (a rollback moved the end back): written now
        if done:
            self.last_row = {**row, "now": self.hub.clock()}
        else:
            self.hub.end_step(**row)
        now = time.monotonic()
        if now - self.status_at >= STATUS_EVERY_S:  # the whole live state as JSON: not at every step
            self.status_at = now
            write_status(self.run_dir, self.hub.live_state(), phase="running", graph=self.summary)

    def write_last_row(self) -> None:
        """The deferred row of the last step, if any (a metrics file that cannot be written is logged,
        never a reason to leave node processes running)."""
        row, self.last_row = self.last_row, None
        if row is None or not self.hub:
            return
        try:
            self.hub.end_step(**row)
        except Exception as e:  # noqa: BLE001
            log.warning("the last metrics row (step %s) was not written: %s", row.get("step"), e)

    def total_steps(self, steps: int) -> None:
        if self.summary is not None:
            self.summary["total_steps"] = steps  # the live view's "step i/N"

    def scaled(self, node: str, replicas: int, was: int) -> None:
        if self.summary is not None:
            self.summary.setdefault("nodes", {})[node] = replicas
        if self.hub:
            self.hub.event("scale", node=node, replicas=replicas, was=was)

    def forget(self, proc: Proc) -> None:
        if self.hub:
            self.hub.forget(proc.spec.node, proc.spec.replica)

    def replanned(self, host: str, moved: dict, text: str) -> None:
        if self.hub:
            self.hub.event("replanned", host=host, moved=moved)
            self.hub.replans.append(text)

    def tick(self, controller) -> None:
        if self.on_tick:
            self.on_tick(controller)
