"""What the run reports while it goes: metrics rows, node up/down gauges, the live view's facts.

The one writer of the metrics hub (and of the summary the live view shows) on the controller's
side; every component that has something to say calls one method here. Without a hub (tests, a
run without metrics) every call is a no-op.

The heavy part, nodes' metric snapshots and a step's row, waits in `backlog` until the control
socket has been quiet for IDLE_S (`catch_up`, from the controller's receive loop), or the next tick
at the latest; in order, so a row holds what came before its step and nothing after.
"""

from __future__ import annotations

import logging
from collections import deque
from pathlib import Path

from flowrl.runtime.controller.procs import Proc

log = logging.getLogger("flowrl.controller")
IDLE_S = 0.002
"""Metrics work waits until the control socket has been quiet this long. Done at once, a trainer's
step (parsing its snapshot, then the step's row: ~2 ms) sat between its `consumed` and its
`published`, so the next version's sync orders and tickets waited for it, every step at k=0."""
QUIET_S = 0.05
"""At shutdown, once every node has exited, the control socket is read until quiet this long: the
last metrics a node sends on its way out may wait there unread (all of them, when every node exited
before the controller first looked)."""


class RunReport:
    def __init__(self, hub, run_dir: Path, summary: dict | None = None, on_tick=None):
        self.hub = hub
        self.run_dir = run_dir
        self.summary = summary
        self.on_tick = on_tick  # the live view's refresh, once per control-loop tick
        self.last_row: dict | None = None  # the last step's row, written once the nodes have stopped
        self.update_staleness = None  # the largest staleness among the tickets of the update under way
        self.backlog: deque = deque()  # (method, *args): metrics work not done yet, in order

    def node_up(self, proc: Proc, up: bool) -> None:
        if self.hub:
            self.hub.set("node_up", int(up), node=proc.spec.node, replica=str(proc.spec.replica), across="min")

    def restarted(self, proc: Proc, why: str) -> None:
        if self.hub:
            self.hub.inc("restarts", node=proc.spec.node, replica=str(proc.spec.replica))
            self.hub.event("restart", node=proc.id, why=why)

    def catch_up(self) -> None:
        """Do the metrics work that waited (the controller calls this once its socket is quiet)."""
        while self.backlog:
            work, *args = self.backlog.popleft()
            work(*args)

    def ingest(self, proc: Proc, metrics: dict | None) -> None:
        if metrics and self.hub:
            self.backlog.append((self._ingest, proc, metrics))

    def _ingest(self, proc: Proc, metrics: dict) -> None:
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
        row = dict(step=completed, policy_version=version, extra={"staleness_max": staleness})
        self.backlog.append((self._step, row, self.hub.clock(), done))

    def _step(self, row: dict, now: float, done: bool) -> None:
        """status.json is not rewritten here: the live view does, every second (`flowrl run` always
        makes one), and the run's end writes the final one. Rewritten here too, every 0.5 s, it
        was ~0.15 ms of the controller's CPU a step of graphs/grpo.yaml for no fresher a file."""
        self._write_last_row()  # one deferred before (a rollback moved the end back): written now
        if done:
            self.last_row = {**row, "now": now}
        else:
            self.hub.end_step(**row, now=now)

    def write_last_row(self) -> None:
        """The deferred row of the last step, if any (a metrics file that cannot be written is logged,
        never a reason to leave node processes running)."""
        self.catch_up()
        self._write_last_row()

    def _write_last_row(self) -> None:
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
            self.catch_up()  # its last snapshots first, or they would bring its series back
            self.hub.forget(proc.spec.node, proc.spec.replica)

    def replanned(self, host: str, moved: dict, text: str) -> None:
        if self.hub:
            self.hub.event("replanned", host=host, moved=moved)
            self.hub.replans.append(text)

    def tick(self, controller) -> None:
        if not controller.sync.in_round():  # not beside a weight-sync round (SyncGroup.in_round)
            self.catch_up()  # at the latest
        if self.on_tick:
            self.on_tick(controller)
