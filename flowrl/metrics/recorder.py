"""The node-side half of metrics: record cheaply, ship deltas.

    rec = Recorder(node="rollout", replica=0)
    rec.count("samples", 64); rec.mean("reward", 0.71); rec.observe("rollout_latency_s", 0.12)
    with rec.span("compute", batch_id="t3"):
        ...
    snap = rec.drain()          # plain dict; the runtime msgpacks it to the controller

`drain()` returns what happened since the previous drain and resets the windowed kinds, so the
controller can add snapshots without double counting and a lost snapshot loses only 0.5 s.
Gauges are sent only when they changed. Time spent in each span is also counted as the per-node
sum `span_s{span=...}` (open spans are accounted up to the drain), which is what the controller
turns into busy / idle ratios per node.

Metrics are run-scoped by default (the row key is the bare name, reduced over every process that
reports it); `per_node=True` keys them per node ("rollout/cpu_percent"), as for process samples.
The recorder is thread-safe; every call is a dict update under a lock.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flowrl.metrics.kinds import (Gauge, Histogram, Max, Mean, Min, Reduction, Sum,
                                  default_buckets)

WIRE_VERSION = 1
SPAN_METRIC = "span_s"
#: CPU seconds: per thread role (label `thread`), of the whole process, of the compute thread
#: inside spans (label `span`), and split by the stack sampler (labels `thread`, `category`).
CPU_THREAD_METRIC, CPU_PROCESS_METRIC = "cpu_thread_s", "cpu_process_s"
SPAN_CPU_METRIC, CPU_SAMPLED_METRIC = "span_cpu_s", "cpu_sampled_s"
#: Span names the runtime uses; the report classifies time by them.
RUNTIME_SPANS = ("wait_input", "compute", "wait_credit", "weight_sync")
#: The node is occupied in these spans (the rest is waiting); weight_snapshot is the trainer
#: copying its weights into the send buckets before a sync.
BUSY_SPANS = ("compute", "weight_sync", "weight_snapshot")
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")
RESERVED_LABELS = ("node", "replica")

SeriesKey = tuple[str, str, bool, tuple[tuple[str, str], ...]]


_CHECKED: set[str] = set()  # names that passed (the same few on every call), at most MAX_CHECKED
MAX_CHECKED = 10_000  # names kept in _CHECKED, and call keys each recorder keeps


def check_name(name: str) -> str:
    if type(name) is str and name in _CHECKED:
        return name
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"metric name {name!r} is not allowed; use letters, digits and '_', "
                         f"starting with a letter (e.g. 'rollout_latency_s'), at most 100 chars")
    if type(name) is str and len(_CHECKED) < MAX_CHECKED:
        _CHECKED.add(name)
    return name


def _labels(labels: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    for k in labels:
        if k in RESERVED_LABELS:
            raise ValueError(f"label {k!r} is set by the recorder itself (node/replica of this "
                             f"process); pass per_node=True or rename the label")
        check_name(k)
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


def _wait_rank(name: str) -> int:
    """0 = work (any span not named wait_*), 1 = blocked (wait_credit ...), 2 = wait_input."""
    return 2 if name == "wait_input" else (1 if name.startswith("wait_") else 0)


def _plain(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


class Recorder:
    """One per node process. `clock` (epoch seconds) is injectable for synthetic runs."""

    def __init__(self, node: str, replica: int = 0, *, clock: Callable[[], float] = time.time,
                 max_spans: int = 50_000):
        self.node, self.replica = node, int(replica)
        self.pid, self.host = os.getpid(), socket.gethostname()
        self._clock = clock
        self._max_spans = max_spans
        self._lock = threading.Lock()
        self._series: dict[SeriesKey, Reduction] = {}
        self._keys: dict[tuple, SeriesKey] = {}  # a call's (name, kind, per_node, *labels) -> its series key
        self._dirty_gauges: set[SeriesKey] = set()
        self._spans: list[list] = []
        self._dropped_spans = 0
        self._threads: dict[str, str] = {}
        self._open: dict[int, list] = {}  # id -> [name, accounted_until (perf_counter)]
        self._seq = 0
        self._since = clock()  # start of the window the next drain covers
        self._sampler = None
        self._cpu = None  # ThreadCpu, from the first sample_cpu()
        self._stacks = None  # StackSampler, when FLOWRL_CPU_SAMPLER allows
        self._loop_prof = None  # LoopProfiler, on the main thread unless FLOWRL_CPU_SAMPLER=0
        self._cpu_at = 0.0

    # --- recording ----------------------------------------------------------------------------
    def _get(self, name: str, cls: type[Reduction], per_node: bool, labels: dict, **init) -> Reduction:
        return self._get_keyed(name, cls, per_node, labels, **init)[1]

    def _get_keyed(self, name: str, cls: type[Reduction], per_node: bool, labels: dict,
                   **init) -> tuple[SeriesKey, Reduction]:
        # the series key of a call seen before, when its label values are strings (a value's str()
        # is its label: 1 and 1.0 are equal keys with different labels, so only strings are kept)
        memo = (name, cls.kind, per_node, *labels.items()) \
            if type(name) is str and all(type(v) is str for v in labels.values()) else None
        key = self._keys.get(memo) if memo is not None else None
        if key is None:
            key = (check_name(name), cls.kind, bool(per_node), _labels(labels))
            if memo is not None and len(self._keys) < MAX_CHECKED:  # labels of many values: not all kept
                self._keys[memo] = key
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = cls(**init)
        return key, series

    def count(self, name: str, value: float = 1, *, per_node: bool = False, **labels: Any) -> None:
        """Sum: samples, tokens, bytes. Replicas add up."""
        with self._lock:
            self._get(name, Sum, per_node, labels).add(value)

    def mean(self, name: str, value: float, *, weight: float = 1.0, per_node: bool = False,
             **labels: Any) -> None:
        """Mean weighted by `weight` (e.g. the number of samples `value` averages over)."""
        with self._lock:
            self._get(name, Mean, per_node, labels).add(value, weight)

    def max(self, name: str, value: float, *, per_node: bool = False, **labels: Any) -> None:
        with self._lock:
            self._get(name, Max, per_node, labels).add(value)

    def min(self, name: str, value: float, *, per_node: bool = False, **labels: Any) -> None:
        with self._lock:
            self._get(name, Min, per_node, labels).add(value)

    def observe(self, name: str, value: float, *, buckets: str | list | None = None,
                per_node: bool = False, **labels: Any) -> None:
        """Histogram with fixed buckets (preset by name: '_s' -> latency, 'staleness' -> ints)."""
        with self._lock:
            h = self._get(name, Histogram, per_node, labels, buckets=buckets or default_buckets(name))
            h.add(value)

    def gauge(self, name: str, value: float, *, across: str = "mean", per_node: bool = False,
              **labels: Any) -> None:
        """Last value; `across` = how replicas combine in the row ('mean', 'max', 'sum', ...)."""
        with self._lock:
            key, g = self._get_keyed(name, Gauge, per_node, labels, across=across)
            g.set(value, self._clock())
            self._dirty_gauges.add(key)

    # --- spans --------------------------------------------------------------------------------
    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """Time a block into the trace ('wait_input', 'compute', 'wait_credit', 'weight_sync')."""
        check_name(name)
        start_wall, t0 = self._clock(), time.perf_counter()
        entry = [name, t0]
        with self._lock:
            self._open[id(entry)] = entry
        try:
            yield
        finally:
            t1 = time.perf_counter()
            with self._lock:
                del self._open[id(entry)]
                self._account(name, t1 - entry[1])
                self._push_span(name, start_wall, t1 - t0, args)

    def add_span(self, name: str, start_s: float, duration_s: float, *, cpu_s: float | None = None,
                 **args: Any) -> None:
        """Record a span measured elsewhere (epoch start seconds, duration seconds); `cpu_s`: the
        CPU seconds its thread used inside it (counted as `span_cpu_s`, shown in the trace)."""
        check_name(name)
        if duration_s < 0:
            raise ValueError(f"span {name!r} has negative duration {duration_s}; spans must end "
                             f"after they start")
        with self._lock:
            self._account(name, duration_s)
            if cpu_s is not None and cpu_s >= 0:
                self._get(SPAN_CPU_METRIC, Sum, True, {"span": name}).add(cpu_s)
                args = {**args, "cpu_ms": round(cpu_s * 1e3, 2)}
            self._push_span(name, start_s, duration_s, args)

    def _account(self, name: str, seconds: float) -> None:
        self._get(SPAN_METRIC, Sum, True, {"span": name}).add(seconds)

    def _push_span(self, name: str, start_s: float, dur_s: float, args: dict) -> None:
        if len(self._spans) >= self._max_spans:
            self._dropped_spans += 1
            return
        thread = threading.current_thread()
        tid = threading.get_native_id()
        self._threads.setdefault(str(tid), thread.name)
        self._spans.append([tid, name, int(start_s * 1e6), max(0, int(dur_s * 1e6)),
                            {k: _plain(v) for k, v in args.items()}])

    def state(self) -> str:
        """What the process does now: the most recently opened open span, where work outranks
        waiting ('compute' while an input task waits in 'wait_input'), or 'idle'."""
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if not self._open:
            return "idle"
        names = [e[0] for e in self._open.values()]  # in opening order
        return min(reversed(names), key=_wait_rank)

    # --- process sampling ---------------------------------------------------------------------
    def sample_process(self) -> dict[str, float]:
        """CPU% and RSS of this process; GPU utilisation, memory and fragmentation where present.
        Recorded as per-node gauges; also returned as {"name" or "name/device": value}."""
        if self._sampler is None:
            from flowrl.metrics.process import ProcessSampler

            self._sampler = ProcessSampler()
        out: dict[str, float] = {}
        for name, value, labels in self._sampler.sample():
            self.gauge(name, value, per_node=True, **labels)
            out["/".join([name, *labels.values()])] = value
        return out

    def sample_cpu(self, min_interval_s: float = 0.2, *, start: bool = True) -> None:
        """CPU seconds since the previous call, per thread role (`cpu_thread_s{thread}`) and for
        the whole process (`cpu_process_s`), and split by category as sampled
        (`cpu_sampled_s{thread, category}`: the event loop's by the loop profiler, which the
        first call starts when made on the main thread; the other threads' with
        FLOWRL_CPU_SAMPLER=1): per-node sums that `flowrl report` turns into its CPU-per-step
        table (breakdown.py). The first call sets the baseline; calls closer than
        `min_interval_s` do nothing; with `start=False`, so does every call before the first (the
        worker's metrics loop makes that one: it owns the loop profiler's SIGPROF timer)."""
        if not start and self._cpu is None:
            return
        now = time.monotonic()
        if now - self._cpu_at < min_interval_s:
            return
        self._cpu_at = now
        if self._cpu is None:
            self._start_cpu_sampling()
        roles, total = self._cpu.read()
        sampled = self._stacks.drain() if self._stacks is not None else {}
        if self._loop_prof is not None and threading.current_thread() is threading.main_thread():
            for category, seconds in self._loop_prof.drain().items():
                sampled[("loop", category)] = sampled.get(("loop", category), 0.0) + seconds
        with self._lock:
            for role, seconds in roles.items():
                self._get(CPU_THREAD_METRIC, Sum, True, {"thread": role}).add(seconds)
            if total > 0:
                self._get(CPU_PROCESS_METRIC, Sum, True, {}).add(total)
            for (role, category), seconds in sampled.items():
                self._get(CPU_SAMPLED_METRIC, Sum, True, {"category": category, "thread": role}).add(seconds)

    def _start_cpu_sampling(self) -> None:
        from flowrl.metrics.loopprof import LoopProfiler
        from flowrl.metrics.stacks import SAMPLED_ROLES, StackSampler, sampling_from_env
        from flowrl.metrics.threads import ThreadCpu

        self._cpu = ThreadCpu()
        try:
            loop, interval = sampling_from_env()
        except ValueError as e:  # a typo in the switch must not end the node: sample without it
            logging.getLogger(__name__).warning("%s; CPU sampling stays off", e)
            loop, interval = False, None
        roles = SAMPLED_ROLES
        if loop and threading.current_thread() is threading.main_thread():  # the event loop's thread
            prof = LoopProfiler()
            if prof.start():
                self._loop_prof = prof
                roles = tuple(r for r in roles if r != "loop")
        if interval is not None:
            self._stacks = StackSampler(interval, roles=roles).start()

    def close(self) -> None:
        """Stop the stack sampler's thread and the loop profiler (if they run)."""
        if self._stacks is not None:
            self._stacks.stop()
            self._stacks = None
        if self._loop_prof is not None:
            self._loop_prof.stop()
            self._loop_prof = None

    # --- shipping -----------------------------------------------------------------------------
    def drain(self) -> dict[str, Any]:
        """Everything since the previous drain, as a msgpack-able dict (see hub.ingest)."""
        now_perf = time.perf_counter()
        with self._lock:
            for name, until in list(self._open.values()):
                self._account(name, now_perf - until)
            for entry in self._open.values():
                entry[1] = now_perf
            metrics = []
            for key, series in list(self._series.items()):
                name, kind, per_node, labels = key
                if kind == "gauge" and key not in self._dirty_gauges:
                    continue
                if kind != "gauge":
                    del self._series[key]  # windowed kinds restart from empty
                metrics.append([name, kind, dict(labels), per_node, series.wire()])
            self._dirty_gauges.clear()
            spans, self._spans = self._spans, []
            dropped, self._dropped_spans = self._dropped_spans, 0
            self._seq += 1
            t, since = self._clock(), self._since
            self._since = t
            return {"v": WIRE_VERSION, "node": self.node, "replica": self.replica, "pid": self.pid,
                    "host": self.host, "t": t, "since": since, "seq": self._seq,
                    "state": self._state(),
                    "metrics": metrics, "spans": spans, "threads": dict(self._threads),
                    "dropped_spans": dropped}
