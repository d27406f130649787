"""The controller-side half of metrics: merge node snapshots, close one row per training step.

    hub = MetricsHub(run_dir, devices=3)
    hub.ingest(snapshot)                                  # from each node, every ~0.5 s
    hub.set("queue_depth", 3, edge="rollout->reward")     # controller gauges
    hub.inc("restarts", node="critic")
    row = hub.end_step(step=5, policy_version=5)          # -> one line of metrics.jsonl
    hub.close()                                           # -> trace.json closed

A step's row holds what was reported between the previous `end_step` and this one. In a pipelined
run (max_staleness >= 1) that window mixes samples of neighbouring steps — the same view a stream
processor gives; the policy version and staleness columns say how far apart they are.

Throughput follows verl: tokens_per_s_per_device = (prompt + response) tokens counted in the step
/ (step time x devices); nodes count tokens with `rec.count("tokens", n)`.

Busy and wait ratios per node process (`actor/busy_ratio`) are not per step: a node reports every
~0.5 s while a step may take 0.2 s, so they cover the trailing `ratio_window_s` (5 s; a row: the
step, when it is longer) of each process's reports — `hub.node_ratios()`.

Thread-safe: the Prometheus server reads from its own thread while the controller writes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowrl.metrics import rows
from flowrl.metrics.activity import Activity
from flowrl.metrics.kinds import Gauge, Histogram, Reduction, Sum, default_buckets
from flowrl.metrics.live_state import build_live_state
from flowrl.metrics.recorder import SPAN_METRIC, Recorder, _labels, check_name
from flowrl.metrics.sinks import sinks_for_run
from flowrl.metrics.trace import CONTROLLER_PID, SEGMENT_EVENTS, TraceWriter, compact_json
from flowrl.metrics.wire import Snapshot, SnapshotError, parse_snapshot

log = logging.getLogger(__name__)

SeriesKey = tuple[str | None, int | None, str, str, tuple, str]
CPU_EVERY_S = 0.5
"""The controller's threads are read this often at most (a read lists and reads /proc, ~0.5 ms on a
2-core VM: at every 0.2 s, as node processes do, it was ~0.2 ms of a graphs/grpo.yaml step)."""


@dataclass
class Series:
    """One stream of one metric from one reporter (a node replica, or the controller)."""

    name: str
    kind: str
    labels: tuple[tuple[str, str], ...]
    scope: str  # "run" or "node"
    node: str | None
    replica: int | None
    window: Reduction | None = None  # since the last end_step; for gauges, the current value
    total: Reduction | None = None  # since the start: Prometheus counters, summaries, histograms
    last: dict[str, float | None] = field(default_factory=dict)  # last closed window's summary
    recent: deque | None = None  # sums labelled `edge`: (hub time, amount), for rates per second


@dataclass
class Reporter:
    node: str
    replica: int
    pid: int
    host: str
    trace_pid: int
    seen_t: float
    state: str = "idle"
    seq: int = 0
    received_t: float = 0.0  # hub clock at the last snapshot
    activity: Activity = field(default_factory=Activity)  # recent snapshots' spans: what node_ratios divides


class MetricsHub:
    """Reduces node snapshots; writes RUN_DIR/metrics.jsonl and RUN_DIR/trace.json."""

    def __init__(self, run_dir: str | os.PathLike, *, devices: int = 1,
                 clock: Callable[[], float] = time.time, trace_segment_events: int = SEGMENT_EVENTS,
                 ratio_window_s: float = 5.0, sinks: list | None = None, cpu: bool = False):
        if devices < 1:
            raise ValueError(f"devices={devices}: throughput is tokens / (step time x devices), "
                             f"so pass the number of devices the run uses (>= 1)")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.devices = devices
        self.ratio_window_s = ratio_window_s  # busy / wait ratios: trailing seconds per process
        self._clock = clock
        self._lock = threading.RLock()
        self.t0 = self._last_end = clock()
        self._series: dict[SeriesKey, Series] = {}
        self._plan: list | None = None  # rows.row_plan of the series: made again when one comes or goes
        self._order: dict = {}  # rows.order_row's memo: the last row's keys in order
        self.reporters: dict[tuple[str, int], Reporter] = {}
        self._window_reporters: set[tuple[str, int]] = set()
        self._run_names: dict[tuple, set[str]] = defaultdict(set)
        self.ratios: dict[tuple[str, int], dict[str, float]] = {}  # those of the last row
        self.derived: dict[str, float] = {}  # numeric contract keys of the last row
        self.last_known: dict[str, float] = {}  # ... and of the last row that had them
        self.rejected = 0
        self.replans: list[str] = []  # processes moved off a lost host (runtime/controller/replan.py), for the live view
        self.dropped_spans = 0
        self.last_row: dict[str, Any] | None = None
        self._wall_offset, self._closed = self._resume_offset(), False
        self.rotate_bytes = 64 << 20
        self._rows = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if self._rows.tell() > 0 and not self._torn_free():
            self._rows.write("\n")  # a crash tore the last row: start ours on a fresh line
        self._move_old_trace()
        self.trace = TraceWriter(self.run_dir / "trace.json", int(self.t0 * 1e6), trace_segment_events)
        self.recorder = Recorder("controller", 0, clock=clock)  # the controller's own spans
        self.cpu = cpu  # account the controller's CPU per thread at each step (`flowrl run` does)
        # TensorBoard / W&B (metrics.sinks); by default those the run's graph.yaml asks for
        self.sinks = list(sinks) if sinks is not None else sinks_for_run(self.run_dir)

    # --- resume: keep earlier rows and trace ---------------------------------------------------
    def _resume_offset(self) -> float:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0.0
        for line in reversed(path.read_text(encoding="utf-8").splitlines()):
            try:
                return float(json.loads(line).get("wall_s") or 0.0)
            except (ValueError, AttributeError):
                continue
        return 0.0

    def _torn_free(self) -> bool:
        with open(self.run_dir / "metrics.jsonl", "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _move_old_trace(self) -> None:
        """An earlier controller's trace.json (a resumed run) becomes the next numbered segment."""
        old = self.run_dir / "trace.json"
        if old.exists():
            from flowrl.segments import next_number

            old.rename(self.run_dir / f"trace.{next_number(old)}.json")

    # --- input --------------------------------------------------------------------------------
    def _series_for(self, node: str | None, replica: int | None, name: str, kind: str,
                    labels: tuple, scope: str) -> Series:
        key = (node, replica, name, kind, labels, scope)
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = Series(name, kind, labels, scope, node, replica)
            self._plan = None  # the rows' grouping changes with the set of series
        return s

    def _add(self, s: Series, value: Reduction) -> None:
        if s.kind == "gauge":
            if s.window is None:
                s.window = value.copy()
            else:
                s.window.merge(value)
            return
        for attr in ("window", "total"):
            acc = getattr(s, attr)
            if acc is None:
                setattr(s, attr, value.copy())
            else:
                acc.merge(value)

    def ingest(self, snapshot: dict[str, Any] | Snapshot) -> None:
        """Merge one node snapshot (Recorder.drain()). Raises SnapshotError on a malformed one
        (counted in `rejected`); the hub's state is unchanged then."""
        with self._lock:
            try:
                snap = snapshot if isinstance(snapshot, Snapshot) else parse_snapshot(snapshot)
                for m in snap.metrics:  # check histogram buckets before changing anything
                    s = self._series.get((snap.node, snap.replica, m.name, m.kind, m.labels,
                                          "node" if m.per_node else "run"))
                    if s is not None and m.kind == "hist" and (s.total or s.window):
                        (s.total or s.window).copy().merge(m.value)
            except (SnapshotError, ValueError) as e:
                self.rejected += 1
                raise SnapshotError(str(e)) from e
            ident = (snap.node, snap.replica)
            rep = self.reporters.get(ident)
            if rep is None or (rep.pid, rep.host) != (snap.pid, snap.host):
                tp = self.trace.track(snap.node, snap.replica, snap.pid, snap.host)
                rep = self.reporters[ident] = Reporter(snap.node, snap.replica, snap.pid,
                                                       snap.host, tp, snap.t)
            self._note_activity(rep, snap)
            rep.seen_t, rep.state, rep.seq = snap.t, snap.state, snap.seq
            self._window_reporters.add(ident)
            for m in snap.metrics:
                scope = "node" if m.per_node else "run"
                if scope == "run" and snap.node != "controller":
                    names = self._run_names[(m.name, m.labels)]
                    if snap.node not in names and len(names) == 1:
                        log.warning("run-scope metric %r%s is reported by nodes %s and %s; their "
                                    "values are reduced together. Record it in one node kind, "
                                    "or pass per_node=True", m.name, dict(m.labels) or "",
                                    next(iter(names)), snap.node)
                    names.add(snap.node)
                series = self._series_for(snap.node, snap.replica, m.name, m.kind, m.labels, scope)
                self._add(series, m.value)
                if m.kind == "sum" and any(k == "edge" for k, _ in m.labels):
                    self._note_rate(series, m.value.value)
            for tid, tname in snap.threads.items():
                self.trace.thread(rep.trace_pid, tid, tname)
            for tid, name, start, dur, args in snap.spans:
                self.trace.complete(rep.trace_pid, tid, name, start, dur, args)
            self.dropped_spans += snap.dropped_spans

    def _note_activity(self, rep: Reporter, snap: Snapshot) -> None:
        """Keep the span seconds of this snapshot with the time it covers, for node_ratios."""
        spans = {dict(m.labels).get("span", "?"): float(m.value.value) for m in snap.metrics
                 if m.name == SPAN_METRIC and m.kind == "sum" and m.per_node}
        since = min(snap.since if snap.since is not None else rep.seen_t, snap.t)
        rep.received_t = self._clock()
        if spans or snap.t > since:
            rep.activity.add(since, snap.t, spans)
        # keep what a row may still ask for: the ratio window, or the step so far if longer
        keep = max(self.ratio_window_s, rep.received_t - self._last_end) + 2.0
        rep.activity.forget_before(snap.t - keep)

    def _note_rate(self, s: Series, amount: float) -> None:
        now = self._clock()
        if s.recent is None:
            s.recent = deque(maxlen=10_000)
        s.recent.append((now, amount))
        while s.recent and s.recent[0][0] < now - self.ratio_window_s - 2.0:
            s.recent.popleft()

    def rate(self, s: Series, window_s: float | None = None) -> float | None:
        """Per second over the trailing window (hub clock) of a sum series that keeps `recent`
        (bytes and messages per edge); None for other series."""
        if s.recent is None:
            return None
        window = self.ratio_window_s if window_s is None else window_s
        with self._lock:
            now = self._clock()
            span = max(1e-9, min(window, now - self.t0))
            return sum(a for t, a in s.recent if t > now - window) / span

    def node_ratios(self, window_s: float | None = None) -> dict[tuple[str, int], dict[str, float]]:
        """{(node, replica): {span: share}} over the trailing `window_s` (default
        `ratio_window_s`) of each process's reports, spans made exclusive (rows.exclusive_ratios).
        A snapshot straddling the window start counts pro rata. Processes silent for longer than
        the window (dead, replaced) are left out, and so is the controller."""
        window = self.ratio_window_s if window_s is None else window_s
        with self._lock:
            now = self._clock()
            out = {}
            for key, rep in self.reporters.items():
                if key[0] == "controller" or not rep.activity or now - rep.received_t > window + 2.0:
                    continue
                raw = rep.activity.shares(window)
                if raw is not None:
                    out[key] = rows.exclusive_ratios(raw)
            return out

    def _controller(self, name: str, kind: str, labels: dict[str, Any]) -> Series:
        node = labels.pop("node", None)
        replica = labels.pop("replica", None)
        return self._series_for(None if node is None else str(node),
                                None if replica is None else int(replica), check_name(name), kind,
                                _labels(labels), "run" if node is None else "node")

    def forget(self, node: str, replica: int) -> None:
        """A replica removed by `flowrl scale`: it reports no more and is not shown as silent."""
        with self._lock:
            self.reporters.pop((node, replica), None)
            self._window_reporters.discard((node, replica))
            for key in [k for k in self._series if k[0] == node and k[1] == replica]:
                del self._series[key]
            self._plan = None

    def set(self, name: str, value: float, *, across: str = "mean", **labels: Any) -> None:
        """Controller gauge, e.g. set("queue_depth", 3, edge="rollout->reward")."""
        with self._lock:
            g = Gauge(value, self._clock(), across)
            self._add(self._controller(name, "gauge", labels), g)

    def inc(self, name: str, amount: float = 1, **labels: Any) -> None:
        """Controller counter, e.g. inc("restarts", node="critic")."""
        with self._lock:
            self._add(self._controller(name, "sum", labels), Sum(amount))

    def observe(self, name: str, value: float, *, buckets: str | list | None = None,
                **labels: Any) -> None:
        """Controller histogram, e.g. observe("staleness", 1) from the scheduler's ledger."""
        with self._lock:
            h = Histogram(buckets or default_buckets(name))
            h.add(value)
            self._add(self._controller(name, "hist", labels), h)

    def event(self, name: str, **args: Any) -> None:
        """An instant marker on the controller track of the trace (restart, fault, resume)."""
        with self._lock:
            self.trace.instant(name, int(self._clock() * 1e6), {k: str(v) for k, v in args.items()})

    # --- one row per step ----------------------------------------------------------------------
    def clock(self) -> float:
        """The hub's clock (what `end_step(now=...)` takes)."""
        return self._clock()

    def end_step(self, step: int, policy_version: int | None = None,
                 extra: dict[str, Any] | None = None, now: float | None = None) -> dict[str, Any]:
        """Reduce the window since the previous step into one row, append it to metrics.jsonl.
        `now`: when the step ended (`clock()` then), if the row is written later; default: now."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"end_step(step={step}) after MetricsHub.close(); the run "
                                   f"directory {self.run_dir} is already finalised")
            if self.cpu:
                self.recorder.sample_cpu(CPU_EVERY_S)
            self.ingest(self.recorder.drain())
            now = self._clock() if now is None or now < self._last_end else now
            step_time = max(now - self._last_end, 1e-9)
            self.ratios = self.node_ratios(max(self.ratio_window_s, step_time))
            if self._plan is None:
                self._plan = rows.row_plan(self._series.values())
            row = rows.build_row(self._series.values(), self.ratios, self._plan)
            tokens = row.get("tokens") or 0
            if policy_version is None:
                policy_version = row.get("policy_version")
            row.update(step=step, wall_s=self._wall_offset + now - self.t0, step_time_s=step_time,
                       policy_version=policy_version, tokens=tokens, samples=row.get("samples") or 0,
                       devices=self.devices, tokens_per_s=tokens / step_time,
                       tokens_per_s_per_device=tokens / (step_time * self.devices),
                       samples_per_s=(row.get("samples") or 0) / step_time)
            row.update(extra or {})
            row = rows.order_row(row, self._order)
            self._rows.write(compact_json(row) + "\n")
            self._rows.flush()
            if self._rows.tell() > self.rotate_bytes:  # a long run: older rows go to metrics.N.jsonl.gz
                from flowrl.segments import rotate

                self._rows.close()
                rotate(self.run_dir / "metrics.jsonl")
                self._rows = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
            self._to_sinks(row)
            self._close_window(now, row)
            return row

    def _to_sinks(self, row: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(row)
            except Exception as e:  # noqa: BLE001 - a logging backend must not end the run
                log.warning("metric sink %s failed (%s); it is switched off", type(sink).__name__, e)
                self.sinks.remove(sink)

    def _close_window(self, now: float, row: dict[str, Any]) -> None:
        for s in self._series.values():
            if s.kind != "gauge":
                if s.window is not None and s.kind in ("mean", "max", "min"):
                    s.last = s.window.summary()
                s.window = None
        self.derived = {k: row[k] for k in rows.LEADING if isinstance(row.get(k), (int, float))}
        self.last_known.update((k, v) for k, v in self.derived.items())
        self._last_end, self.last_row = now, row
        self._window_reporters.clear()
        now_us = int(now * 1e6)
        counters: dict[tuple[int, str], dict[str, float]] = defaultdict(dict)
        for s in self._series.values():
            if s.kind != "gauge" or s.window is None or s.window.value is None:
                continue
            rep = self.reporters.get((s.node, s.replica)) if s.node else None
            if rep is not None:  # a node replica's gauge: on that process's track
                counters[(rep.trace_pid, s.name)]["/".join(v for _, v in s.labels) or "value"] = \
                    s.window.value
            else:  # a controller gauge: on the controller track
                key = "/".join([s.node or "", *(v for _, v in s.labels)]).strip("/") or "value"
                counters[(CONTROLLER_PID, s.name)][key] = s.window.value
        for (pid, name), values in counters.items():
            self.trace.counter(name, now_us, values, pid=pid)
        self.trace.flush()

    # --- views --------------------------------------------------------------------------------
    def series(self) -> list[Series]:
        """Copies of every series (for exporters running on other threads)."""
        with self._lock:
            return [Series(s.name, s.kind, s.labels, s.scope, s.node, s.replica,
                           s.window.copy() if s.window else None,
                           s.total.copy() if s.total else None, dict(s.last))
                    for s in self._series.values()]

    def live_state(self) -> dict[str, Any]:
        """What the live view and `flowrl status` show: JSON-able, see live_state.py."""
        with self._lock:
            return build_live_state(self, self._clock())

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.recorder.close()
            try:
                self.ingest(self.recorder.drain())
            finally:
                self.trace.close()
                self._rows.close()
                for sink in self.sinks:
                    try:
                        sink.close()
                    except Exception as e:  # noqa: BLE001
                        log.warning("metric sink %s did not close cleanly: %s", type(sink).__name__, e)

    def __enter__(self) -> MetricsHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

