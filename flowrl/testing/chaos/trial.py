"""Run a shape for real — fault-free (the reference) or under a fault schedule — and judge the run.

    ref = run_reference(shape, workdir)                 # must complete, state == model
    res = run_trial(shape, schedule, workdir, ref=ref)  # completed / failed_clear / failed_unclear / hung
    assert res.ok, res.explain()

The time bound a run must end within (finished, or failed with a named error) comes from the
graph's own timeouts (`bound_s`); a run still going `HANG_GRACE_S` after it is killed and counted
as hung.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from flowrl.testing.chaos.check import (
    check_ledger,
    compare_state,
    names_the_culprit,
    read_final_states,
)
from flowrl.testing.chaos.features import Features
from flowrl.testing.chaos.model import Expected, default_batch_id, simulate
from flowrl.testing.chaos.schedules import Schedule
from flowrl.testing.chaos.shapes import Shape

HANG_GRACE_S = 20.0
DEFAULT_REF_S = 15.0
"""Fault-free wall time assumed when the reference run did not complete."""


def bound_s(shape: Shape, faults: int, ref_wall_s: float | None) -> float:
    """Seconds within which a run must end (finished, or failed naming the culprit):

        base    = 2 x fault-free wall time + 10          (load on a shared machine)
        detect  = max(deadline_s, process_timeout_s) + heartbeat_s + 0.5
        recover = detect + backoff_s * 2^max_restarts + 5   (a restart, rollback and replay)
        stuck   = (max_attempts + 1) x (ticket_timeout_s + detect)   (a ticket that cannot finish)
        bound   = base + faults x recover + stuck
    """
    t = shape.timing
    base = 2 * (ref_wall_s if ref_wall_s is not None else DEFAULT_REF_S) + 10
    detect = max(t.deadline_s, t.process_timeout_s) + t.heartbeat_s + 0.5
    recover = detect + t.backoff_s * 2 ** t.max_restarts + 5
    stuck = (t.max_attempts + 1) * (t.ticket_timeout_s + detect)
    return base + faults * recover + stuck


@dataclass
class TrialResult:
    shape: int
    schedule: str
    """Schedule id (`sSHAPE.SEED`), or `ref` for the fault-free reference."""
    faults: list[str]
    kinds: list[str]
    recoverable: bool
    exit_code: int
    wall_s: float
    bound_s: float
    outcome: str
    """completed | failed_clear | failed_unclear | hung"""
    ledger: list[str] = field(default_factory=list)
    """Exactly-once violations."""
    state: list[str] = field(default_factory=list)
    """Stateful nodes whose final state differs from the model's."""
    restarts: int = 0
    """`node_down` events in the ledger (faults that hit a live node, and any other restart)."""
    error: str = ""
    """The run's failure message (stderr tail), if it failed."""
    run_dir: str = ""
    substituted: list[str] = field(default_factory=list)
    traits: list[str] = field(default_factory=list)
    """The shape's traits (`Shape.traits`)."""

    @property
    def late(self) -> bool:
        return self.outcome != "hung" and self.wall_s > self.bound_s

    @property
    def reasons(self) -> list[str]:
        """Why this run breaks the contract (empty: it holds)."""
        out = []
        if self.outcome == "hung":
            out.append(f"hung: still running after {self.wall_s:.0f} s (bound {self.bound_s:.0f} s), killed")
        elif self.outcome == "failed_unclear":
            out.append(f"failed (exit {self.exit_code}) without naming a node or ticket")
        elif self.outcome == "failed_clear" and self.recoverable:
            out.append(f"failed (exit {self.exit_code}) although every fault was recoverable")
        if self.late:
            out.append(f"ended after {self.wall_s:.0f} s, past the bound of {self.bound_s:.0f} s")
        out += [f"ledger: {v}" for v in self.ledger]
        out += [f"state: {v}" for v in self.state]
        return out

    @property
    def ok(self) -> bool:
        return not self.reasons

    def explain(self, shape: Shape | None = None) -> str:
        lines = [(f"{self.schedule} faults {self.faults or '-'} kinds {self.kinds or '-'}: {self.outcome} "
                  f"(exit {self.exit_code}, {self.wall_s:.1f} s, bound {self.bound_s:.0f} s, {self.restarts} restarts)")]
        lines += ["  " + r for r in self.reasons]
        if self.substituted:
            lines.append("  substituted: " + "; ".join(self.substituted))
        if self.error:
            lines.append("  error: " + self.error.strip().replace("\n", "\n    ")[:1500])
        if shape is not None:
            lines.append(shape.describe())
        lines.append(f"  run dir: {self.run_dir}")
        return "\n".join(lines)


def _error_excerpt(stderr: str) -> str:
    keep = [ln for ln in stderr.splitlines() if "WARNING flowrl.metrics.hub" not in ln]
    text = "\n".join(keep)
    at = text.find("run failed")
    return text[at:][:2000] if at >= 0 else text[-1200:]


def run_shape(shape: Shape, run_dir: Path, schedule: Schedule | None = None, *, features: Features | None = None,
              ref_wall_s: float | None = None, expected: Expected | None = None,
              hang_s: float | None = None, reference_states: dict[str, dict] | None = None) -> TrialResult:
    """Run `shape` once under `schedule` (None: fault-free) and check it: the ledger against the
    model, the stateful nodes' final states against `reference_states` (a fault-free run's, itself
    checked against the model) or, without those, against the model."""
    from flowrl.graph import dump_graph
    from flowrl.testing import read_jsonl, run_graph

    features = features or Features.detect()
    faults = list(schedule.faults) if schedule else []
    bound = bound_s(shape, len(faults), ref_wall_s)
    limit = float(os.environ.get("FLOWRL_CHAOS_HANG_S", "0")) or bound + HANG_GRACE_S
    limit = min(limit, hang_s) if hang_s else limit
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    graph = run_dir.with_name(run_dir.name + ".graph.yaml")
    graph.write_text(dump_graph(shape.graph(features)))
    t0 = time.monotonic()
    result = run_graph(graph, run_dir, faults=faults, timeout_s=limit)
    wall = time.monotonic() - t0
    run_dir.with_name(run_dir.name + ".stderr.txt").write_text(result.stderr)
    rows = read_jsonl(run_dir / "ledger.jsonl")
    ids = {r["index"]: r["batch_id"] for r in rows if r.get("event") == "issued" and "index" in r}
    if expected is None or any(b != default_batch_id(i) for i, b in ids.items()):
        expected = simulate(shape, lambda i: ids.get(i, default_batch_id(i)))
    hung = result.exit_code == -9 and "[flowrl.testing] killed after" in result.stderr
    if hung:
        outcome = "hung"
    elif result.exit_code == 0:
        outcome = "completed"
    else:
        outcome = "failed_clear" if names_the_culprit(result.stderr, list(shape.nodes)) else "failed_unclear"
    complete = outcome == "completed"
    ledger = check_ledger(rows, shape.sinks, expected, expected.total if complete else None).violations(complete)
    state: list[str] = []
    if complete:
        try:
            step, states = read_final_states(run_dir)
        except Exception as e:  # noqa: BLE001 - an unreadable checkpoint is a finding, not a crash
            step, states = None, {}
            state.append(f"final checkpoint unreadable: {type(e).__name__}: {e}")
        if shape.stateful and step != expected.total:
            state.append(f"final checkpoint is step {step}, want {expected.total}")
        for node in shape.stateful:
            want = (reference_states or {}).get(node) or expected.states[node]
            diff = compare_state(node, states.get(node), want)
            if diff:
                state.append(diff + (" (vs the fault-free run)" if reference_states else ""))
    return TrialResult(
        shape=shape.seed, schedule=schedule.id if schedule else "ref", faults=faults,
        kinds=list(schedule.kinds) if schedule else [], recoverable=schedule.recoverable if schedule else True,
        exit_code=result.exit_code, wall_s=wall, bound_s=bound, outcome=outcome, ledger=ledger, state=state,
        restarts=sum(1 for r in rows if r.get("event") == "node_down"),
        error="" if complete else _error_excerpt(result.stderr), run_dir=str(run_dir),
        substituted=list(schedule.substituted) if schedule else [], traits=shape.traits())
