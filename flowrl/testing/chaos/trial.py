"""Run a shape for real — fault-free (the reference) or under a fault schedule — and judge the run.

    ref = run_reference(shape, workdir)                 # must complete, state == model
    res = run_trial(shape, schedule, workdir, ref=ref)  # completed / failed_clear / failed_unclear / hung
    assert res.ok, res.explain()

The time bound a run must end within (finished, or failed with a named error) comes from the
graph's own timeouts (`bound_s`); a run still going `HANG_GRACE_S` after it is killed and counted
as hung. Before the kill, every node process is asked to write what it waits on into its log
(`flowrl status --dump`); `TrialResult.hang` keeps one line per process (`hang_signature`), the
whole dump goes to `RUN.hang.txt` next to the run directory.

A schedule's scale events (`Schedule.scales`) are carried out while the run goes on: `Scaler`
reads the ledger as it grows and asks the controller (`flowrl scale`, the same request) once the
event's ticket count completed; a refusal while the run recovers is asked again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
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
from flowrl.testing.harness import hang_signature

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

    A scale event counts as a fault (a process started or stopped, a weight-sync epoch formed).
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
    scales: list[str] = field(default_factory=list)
    """The schedule's scale events."""
    scaled: list[str] = field(default_factory=list)
    """What became of each scale event: `scale:...: fired at N completed: <the controller's answer>`,
    `refused: ...`, or `not fired (...)`."""
    scale_errors: list[str] = field(default_factory=list)
    """Scale requests the controller did not answer, or refused for a reason other than recovery."""
    weights: list[str] = field(default_factory=list)
    """Versions a subscriber took that were not whole (`nodes.WEIGHT_MISMATCH` in its log)."""
    hang: list[str] = field(default_factory=list)
    """For a hung run: what each node process waited on when it was killed (`hang_signature`)."""
    overlap: dict[str, int] = field(default_factory=dict)
    """Per node with `concurrency` > 1: the most of its calls one process had in flight together
    (`nodes.OVERLAP` in its logs; 1 when they never overlapped)."""
    stuck: list[str] = field(default_factory=list)
    """For a run that did not complete: processes that were inside a collective when its group went
    away (`collective_waits`): a rank waiting for partners that never came."""

    @property
    def scales_fired(self) -> int:
        return sum(1 for x in self.scaled if ": fired at " in x)

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
        out += [f"weights: {v}" for v in self.weights]
        out += [f"scale: {v}" for v in self.scale_errors]
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
        if self.scaled:
            lines.append("  scale events: " + "; ".join(self.scaled))
        if self.hang:
            lines.append("  waiting when killed:\n    " + "\n    ".join(self.hang))
        if self.stuck:
            lines.append("  inside a collective when its group went away:\n    " + "\n    ".join(self.stuck))
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


@dataclass
class ScaleEvent:
    """`scale:NODE=R@completed=N[,after=NODE/REPLICA]` (see `Schedule.scales`)."""

    node: str
    replicas: int
    completed: int
    after: str | None = None
    spec: str = ""

    @classmethod
    def parse(cls, text: str) -> ScaleEvent:
        action, _, rest = text.partition(":")
        target, _, when = rest.partition("@")
        node, _, replicas = target.partition("=")
        opts = dict(kv.split("=", 1) for kv in when.split(",") if "=" in kv)
        if action != "scale" or not node or not replicas.isdigit() or "completed" not in opts:
            raise ValueError(f"scale event {text!r}: write scale:NODE=R@completed=N[,after=NODE/REPLICA]")
        return cls(node, int(replicas), int(opts["completed"]), opts.get("after"), text)


class LedgerTail:
    """The rows appended to a ledger since the last read (whole lines only)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rest = Path(path), 0, b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        rows = []
        for line in lines:
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
        return rows


class Scaler:
    """Carries out scale events while a run goes on, one after another, each once its ticket count
    completed (read from the ledger as it grows) and, with `after=NODE/R`, once that replica went
    down (a `node_down` row) and came back (its log says a later incarnation is ready, or three more
    tickets completed). A request runs in a thread, so a controller that does not answer cannot stop
    the watch for a hang."""

    RETRY_S = 0.5
    ANSWER_S = 30.0

    def __init__(self, run_dir: Path, specs: list[str]):
        self.run_dir = Path(run_dir)
        self.events = [ScaleEvent.parse(s) for s in specs]
        self.tail = LedgerTail(self.run_dir / "ledger.jsonl")
        self.completed = 0
        self.down_at: dict[str, int] = {}
        self.outcomes: list[str] = []
        self.errors: list[str] = []
        self.next = 0
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()

    def poll(self) -> None:
        for r in self.tail.read():
            if r.get("event") == "completed":
                self.completed += 1
            elif r.get("event") == "node_down" and isinstance(r.get("node"), str):
                self.down_at.setdefault("/".join(r["node"].split("/")[:2]), self.completed)
        if self.thread is not None:
            if self.thread.is_alive():
                return
            self.thread = None
            self.next += 1
        if self.next >= len(self.events):
            return
        e = self.events[self.next]
        if self.completed >= e.completed and (e.after is None or self._came_back(e.after)):
            self.thread = threading.Thread(target=self._request, args=(e, self.completed), daemon=True,
                                           name=f"scale {e.node}={e.replicas}")
            self.thread.start()

    def _came_back(self, who: str) -> bool:
        if who not in self.down_at:
            return False
        node, _, replica = who.partition("/")
        log = self.run_dir / "logs" / f"{node}.{replica}.0.log"
        with contextlib.suppress(OSError):
            if re.search(r"ready [\d.]+ s after start \(incarnation [1-9]", log.read_text(errors="replace")):
                return True
        return self.completed >= self.down_at[who] + 3

    def _request(self, e: ScaleEvent, at: int) -> None:
        from flowrl.runtime.controller.scaling import ScaleError, request

        while not self.stop.is_set():
            try:
                answer = request(self.run_dir, e.node, e.replicas, timeout_s=self.ANSWER_S)
            except ScaleError as err:
                why = str(err)
                if "recovering" in why or "missing or unreadable" in why:  # "try again in a moment", or
                    self.stop.wait(self.RETRY_S)                              # the control file is not there yet
                    continue
                self.outcomes.append(f"{e.spec}: refused at {at} completed: {why}")
                self.errors.append(f"{e.spec}: {why}")
                return
            self.outcomes.append(f"{e.spec}: fired at {at} completed: {answer}")
            return
        self.outcomes.append(f"{e.spec}: not fired (the run ended while it was refused: recovering)")

    def finish(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(self.ANSWER_S + 5)
            self.next += 1
        for e in self.events[self.next:]:
            self.outcomes.append(f"{e.spec}: not fired (the run ended at {self.completed} completed)")


@dataclass
class Launched:
    exit_code: int
    stderr: str
    hung: bool
    scaled: list[str]
    scale_errors: list[str]
    hang: list[str]


def launch(graph: Path, run_dir: Path, faults: list[str], scales: list[str], limit_s: float) -> Launched:
    """`flowrl run` in a child (its own process group), the scale events carried out as it goes; at
    `limit_s` the node processes dump what they wait on, then the group is killed."""
    from flowrl.testing.harness import flowrl_command, kill_group

    out_path = run_dir.with_name(run_dir.name + ".stdout.txt")
    err_path = run_dir.with_name(run_dir.name + ".stderr.txt")
    scaler = Scaler(run_dir, scales) if scales else None
    hung, hang = False, []
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(flowrl_command(graph, run_dir, faults=faults), stdout=out, stderr=err,
                                start_new_session=True)
        t0 = time.monotonic()
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > limit_s:
                    hung = True
                    hang = hang_signature(run_dir)
                    break
                if scaler is not None:
                    scaler.poll()
                time.sleep(0.2)  # polling the run's progress on disk, not ordering events
        finally:
            if proc.poll() is None:
                kill_group(proc.pid)
            proc.wait()
            kill_group(proc.pid)  # anything of the run's group that outlived the controller
            if scaler is not None:
                scaler.finish()
    stderr = err_path.read_text(errors="replace")
    if hung:
        stderr += f"\n[flowrl.testing] killed after {limit_s} s"
        err_path.write_text(stderr)
    return Launched(-9 if hung else proc.returncode, stderr, hung, scaler.outcomes if scaler else [],
                    scaler.errors if scaler else [], hang)


COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "barrier", "all_to_all", "reduce_scatter", "gather", "scatter")
FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+, in (?P<fn>\S+)')


def collective_waits(run_dir: Path) -> list[str]:
    """Node processes whose log ends a traceback inside a torch.distributed collective (gloo:
    "Connection closed by peer", a timeout): one line each, the call chain from the worker's main
    loop, e.g. `trainer/0/0: main_loop > on_arrival > admit > run > consume > publish_snapshot > ...
    > all_gather`. A rank that waited there until its partners died was in a collective they never
    reached."""
    out = []
    for log in sorted((Path(run_dir) / "logs").glob("*.log")):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        chains, chain = [], None
        for line in lines:
            if line.startswith("Traceback (most recent call last)"):
                chain = []
                continue
            m = FRAME.match(line)
            if chain is not None and m:
                chain.append(m["fn"])
            elif chain is not None and line and not line.startswith(" "):
                chains.append(chain)  # the exception line ends the traceback
                chain = None
        stuck = [c for c in chains if any(fn in COLLECTIVES for fn in c)]
        if not stuck:
            continue
        c = stuck[-1]
        c = c[c.index("main_loop"):] if "main_loop" in c else c
        end = max(i for i, fn in enumerate(c) if fn in COLLECTIVES)
        out.append(f"{log.stem.replace('.', '/')}: {' > '.join(c[:end + 1])}")
    return out


def weight_mismatches(run_dir: Path) -> list[str]:
    """What subscribers logged about versions that were not whole (`nodes.WEIGHT_MISMATCH`)."""
    from flowrl.testing.chaos.nodes import WEIGHT_MISMATCH

    out = []
    for log in sorted((Path(run_dir) / "logs").glob("*.log")):
        with contextlib.suppress(OSError):
            for line in log.read_text(errors="replace").splitlines():
                if WEIGHT_MISMATCH in line:
                    out.append(f"{log.stem.replace('.', '/')}: {line.split(WEIGHT_MISMATCH, 1)[1].strip()}")
    return out


def overlaps(run_dir: Path, shape: Shape) -> dict[str, int]:
    """Per node of `shape` with `concurrency` > 1: the most calls one of its processes had in flight
    together (what `nodes.Overlapping` logged; 1 if nothing)."""
    from flowrl.testing.chaos.nodes import OVERLAP

    out = {n: 1 for n, d in shape.nodes.items() if d.concurrency > 1}
    for log in sorted((Path(run_dir) / "logs").glob("*.log")):
        node = log.stem.split(".")[0]
        if node not in out:
            continue
        with contextlib.suppress(OSError):
            for m in re.finditer(rf"{OVERLAP} (\d+) calls in flight", log.read_text(errors="replace")):
                out[node] = max(out[node], int(m[1]))
    return out


def run_shape(shape: Shape, run_dir: Path, schedule: Schedule | None = None, *, features: Features | None = None,
              ref_wall_s: float | None = None, expected: Expected | None = None,
              hang_s: float | None = None, reference_states: dict[str, dict] | None = None) -> TrialResult:
    """Run `shape` once under `schedule` (None: fault-free) and check it: the ledger against the
    model, the stateful nodes' final states against `reference_states` (a fault-free run's, itself
    checked against the model) or, without those, against the model."""
    from flowrl.graph import dump_graph
    from flowrl.testing import read_jsonl

    features = features or Features.detect()
    faults = list(schedule.faults) if schedule else []
    scales = list(schedule.scales) if schedule else []
    bound = bound_s(shape, len(faults) + len(scales), ref_wall_s)
    limit = float(os.environ.get("FLOWRL_CHAOS_HANG_S", "0")) or bound + HANG_GRACE_S
    limit = min(limit, hang_s) if hang_s else limit
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    graph = run_dir.with_name(run_dir.name + ".graph.yaml")
    graph.write_text(dump_graph(shape.graph(features)))
    t0 = time.monotonic()
    result = launch(graph, run_dir, faults, scales, limit)
    wall = time.monotonic() - t0
    rows = read_jsonl(run_dir / "ledger.jsonl")
    ids = {r["index"]: r["batch_id"] for r in rows if r.get("event") == "issued" and "index" in r}
    if expected is None or any(b != default_batch_id(i) for i, b in ids.items()):
        expected = simulate(shape, lambda i: ids.get(i, default_batch_id(i)))
    hung = result.hung
    if hung:
        outcome = "hung"
    elif result.exit_code == 0:
        outcome = "completed"
    else:
        outcome = "failed_clear" if names_the_culprit(result.stderr, list(shape.nodes)) else "failed_unclear"
    complete = outcome == "completed"
    ledger = check_ledger(rows, shape.sinks, expected, expected.total if complete else None).violations(complete)
    weights = weight_mismatches(run_dir)
    state: list[str] = []
    if complete:
        try:
            step, states = read_final_states(run_dir)
        except Exception as e:  # noqa: BLE001 - an unreadable checkpoint is a finding, not a crash
            step, states = None, {}
            state.append(f"final checkpoint unreadable: {type(e).__name__}: {e}")
        if shape.stateful and step != expected.total:
            state.append(f"final checkpoint is step {step}, want {expected.total}")
        for node in shape.state_keys:
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
        substituted=list(schedule.substituted) if schedule else [], traits=shape.traits(), scales=scales,
        scaled=result.scaled, scale_errors=result.scale_errors, weights=weights, hang=result.hang,
        overlap=overlaps(run_dir, shape), stuck=[] if complete else collective_waits(run_dir))
