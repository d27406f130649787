"""RUN_DIR/trace.json: Chrome trace events, one track (pid) per node process, opened by Perfetto
(https://ui.perfetto.dev) or chrome://tracing.

The file is the JSON *array* format, streamed: "[" then one event per line, and "]" at close.
A run that crashes still leaves a trace Perfetto opens (the format allows the missing "]"), and
`load_trace` reads it too. Timestamps are microseconds since the controller started, so every
node process on every host lands on one time axis (wall clock; hosts should run NTP).

Track ids are small integers given out in order of first appearance, not OS pids: OS pids collide
across hosts and a restarted process should get a new, separately named track
("rollout/0 pid 4242@host").

A long run's trace is kept in segments: past `segment_events` events the file is closed and
compressed into the next numbered segment, `trace.N.json.gz` (a thread does it; Perfetto opens it
as it is), and trace.json starts anew, every track and thread named again. Each file begins with a
`trace_segment` metadata event: the controller's start (`t0_us`, the time axis), its number in
this controller's trace (0, 1, ...), and the file its predecessor went to (`previous`).
`load_recent_trace(run_dir)` reads trace.json with that predecessor, so a report right after a
rotation still sees a full segment's events.

    w = TraceWriter(run_dir / "trace.json", t0_us)      # -> trace.json, trace.1.json.gz, ...
    events = load_recent_trace(run_dir)                  # the newest one to two segments
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any, TextIO

import orjson

from flowrl.segments import compress, next_number, numbered, open_text

log = logging.getLogger(__name__)

CONTROLLER_PID = 1
#: Spans of one thread that overlap without nesting (two asyncio tasks of one event loop, e.g. an
#: input task waiting while the main task computes) would be mis-drawn by Perfetto, which wants
#: slices of a thread properly nested: such a span goes to an extra lane of that thread, a
#: separate track named "<thread> lane N" (tid LANE_BASE + tid * 8 + N).
LANE_BASE = 1 << 40
MAX_LANES = 4
CATEGORIES = {"wait_input": "wait", "wait_credit": "wait", "compute": "compute",
              "weight_sync": "sync", "weight_snapshot": "sync"}
MAX_HEADS = 1000  # span names whose event head is kept (a node naming spans without end gets no more)
SEGMENT_EVENTS = 500_000
"""Events per trace file (~55 MB; ~20,000 steps of graphs/grpo.yaml); `load_recent_trace` reads two
files at most, so a report's memory stays that of about a million events."""
SEGMENT_META = "trace_segment"


def compact_json(obj: Any) -> str:
    """`obj` as compact JSON, the way `json.dumps(obj, separators=(",", ":"))` writes it but ~8x
    faster (orjson: a 220-key metrics row in 10 us instead of 80, the controller's row and trace
    events at every step). Differences a JSON reader cannot see: exponents without padding (1e-8,
    not 1e-08), text as UTF-8 rather than \\u escapes, NaN and infinities as null instead of JSON's
    invalid NaN. What orjson refuses (a numpy scalar, an int past 64 bits) goes through json."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(obj, separators=(",", ":"))



class TraceWriter:
    """Appends Chrome trace events to `path`, in segments of `segment_events` (module docstring)."""

    def __init__(self, path: str | os.PathLike, t0_us: int, segment_events: int = SEGMENT_EVENTS):
        if segment_events < 1:
            raise ValueError(f"segment_events={segment_events}: a trace file must hold at least one event")
        self.path = Path(path)
        self.t0_us = t0_us
        self.segment_events = segment_events
        self.events = 0  # in the current file
        self.segment = 0  # the current file's number in this writer's trace
        self._tracks: dict[tuple, int] = {}
        self._threads: dict[tuple[int, int], str] = {}
        self._lanes: dict[tuple[int, int], list[deque]] = {}
        self._ends: dict[tuple[int, int], int] = {}  # per thread: the latest end of its spans so far
        self._lane_ends: dict[tuple[int, int], list[int]] = {}  # ... and of each of its lanes' spans
        self._heads: dict[str, str] = {}  # a complete event's JSON up to its pid, by span name
        self._counters: dict[tuple[int, str], dict] = {}  # per counter track: the values last written
        self._compressing: list[threading.Thread] = []
        self._f: TextIO | None = None
        self._open(previous=None)

    def _open(self, previous: str | None) -> None:
        """Start a file: its segment event, then every name known so far (each file stands alone)."""
        self._f = open(self.path, "w", encoding="utf-8")
        self._f.write("[")
        self._first = True
        self.events = 0
        self._meta(CONTROLLER_PID, None, SEGMENT_META, {"t0_us": self.t0_us, "segment": self.segment,
                                                        "previous": previous})
        self._meta(CONTROLLER_PID, None, "process_name", {"name": "controller"})
        self._meta(CONTROLLER_PID, None, "process_sort_index", {"sort_index": 0})
        for (node, replica, os_pid, host), pid in self._tracks.items():
            if pid != CONTROLLER_PID:
                self._track_meta(pid, node, replica, os_pid, host)
        for (pid, tid), name in self._threads.items():
            self._meta(pid, tid, "thread_name", {"name": name})
        self._counters.clear()  # a counter's value is written again in the new file

    def _rotate(self) -> None:
        """Close the full file, move it to the next segment's name and compress it there (a thread:
        a segment takes seconds, which the controller's loop must not spend), start trace.json anew."""
        self._f.write("\n]\n")
        self._f.close()
        moved = self.path.with_name(f"{self.path.stem}.{next_number(self.path)}{self.path.suffix}")
        try:
            os.replace(self.path, moved)
        except OSError as e:  # the trace must never end the run: this segment's events are lost
            log.warning("trace segment %s could not be moved to %s (%s); its events are not kept", self.path, moved, e)
            previous = None
        else:
            self._compressing = [t for t in self._compressing if t.is_alive()]
            t = threading.Thread(target=_compress, args=(moved,), name="flowrl-trace-gzip", daemon=True)
            t.start()
            self._compressing.append(t)
            previous = moved.name + ".gz"
        self.segment += 1
        self._open(previous=previous)

    def _write(self, ev: dict[str, Any], meta: bool = False) -> None:
        self._emit(compact_json(ev), meta)

    def _emit(self, line: str, meta: bool = False) -> None:
        """Append one event, written as JSON (`line`)."""
        if self._f is None:
            return
        if not meta and self.events >= self.segment_events:
            self._rotate()
        self._f.write(("\n" if self._first else ",\n") + line)
        self._first = False
        self.events += not meta

    def _meta(self, pid: int, tid: int | None, name: str, args: dict) -> None:
        ev = {"ph": "M", "name": name, "pid": pid, "tid": 0 if tid is None else tid, "ts": 0,
              "args": args}
        self._write(ev, meta=True)

    def _ts(self, abs_us: int) -> int:
        return max(0, int(abs_us) - self.t0_us)

    def track(self, node: str, replica: int, os_pid: int, host: str) -> int:
        """The trace pid of one node process, announcing its name on first sight."""
        key = (node, replica, os_pid, host)
        pid = self._tracks.get(key)
        if pid is None and node == "controller" and os_pid == os.getpid():
            pid = self._tracks[key] = CONTROLLER_PID  # the hub's own recorder
        if pid is None:
            pid = self._tracks[key] = CONTROLLER_PID + 1 + sum(p != CONTROLLER_PID for p in self._tracks.values())
            self._track_meta(pid, node, replica, os_pid, host)
        return pid

    def _track_meta(self, pid: int, node: str, replica: int, os_pid: int, host: str) -> None:
        self._meta(pid, None, "process_name", {"name": f"{node}/{replica}"})
        self._meta(pid, None, "process_labels", {"labels": f"pid {os_pid}@{host}"})
        self._meta(pid, None, "process_sort_index", {"sort_index": pid})

    def thread(self, pid: int, tid: int, name: str) -> None:
        if (pid, tid) not in self._threads:
            self._threads[(pid, tid)] = name
            self._meta(pid, tid, "thread_name", {"name": name})

    def _lane(self, pid: int, tid: int, start: int, end: int) -> int:
        """`tid`, or the tid of the first lane where [start, end] crosses no recent span."""
        lanes = self._lanes.get((pid, tid))
        if lanes is None:
            lanes = self._lanes[(pid, tid)] = [deque(maxlen=64)]
            self._ends[(pid, tid)] = 0
            self._lane_ends[(pid, tid)] = [0]
        if start >= self._ends[(pid, tid)]:  # after every span of this thread so far (the common case):
            lanes[0].append((start, end))     # it crosses none
            self._ends[(pid, tid)] = end
            self._lane_ends[(pid, tid)][0] = end
            return tid
        lane_ends = self._lane_ends[(pid, tid)]
        for k, recent in enumerate(lanes):
            # after every span of lane k (it crosses none there), or crossing none of its recent ones
            if start >= lane_ends[k] or not any(s < start < e < end or start < s < end < e for s, e in recent):
                break
        else:
            if len(lanes) < MAX_LANES:
                lanes.append(deque(maxlen=64))
                lane_ends.append(0)
            k = len(lanes) - 1
        lanes[k].append((start, end))
        lane_ends[k] = max(lane_ends[k], end)
        self._ends[(pid, tid)] = max(self._ends[(pid, tid)], end)
        if k == 0:
            return tid
        lane = LANE_BASE + tid * 8 + k
        if (pid, lane) not in self._threads:
            self.thread(pid, lane, f"{self._threads.get((pid, tid), tid)} lane {k}")
        return lane

    def complete(self, pid: int, tid: int, name: str, start_us: int, dur_us: int,
                 args: dict | None = None) -> None:
        ts, dur = self._ts(start_us), max(0, int(dur_us))
        tid = self._lane(pid, tid, ts, ts + dur)
        # written as json.dumps writes the event {"ph": "X", "name", "cat", "pid", "tid", "ts", "dur"
        # [, "args"]}: the part up to "pid" is made once per span name (a few per process), the
        # rest from ints, so only the args go through json.dumps (a span each step of every process)
        head = self._heads.get(name)
        if head is None:
            head = '{"ph":"X","name":%s,"cat":%s,"pid":' % (compact_json(name), compact_json(CATEGORIES.get(name, "user")))
            if len(self._heads) < MAX_HEADS:
                self._heads[name] = head
        tail = f',"args":{compact_json(args)}}}' if args else "}"
        self._emit(f'{head}{int(pid)},"tid":{int(tid)},"ts":{ts},"dur":{dur}{tail}')

    def counter(self, name: str, abs_us: int, values: dict[str, float], pid: int = CONTROLLER_PID) -> None:
        """A counter track's values from `abs_us` on. Values equal to the track's last ones are not
        written again: a counter holds its value until the next event (a row's gauges are mostly
        unchanged from the step before, and each was a line of the file and a JSON encoding)."""
        if self._counters.get((pid, name)) == values:
            return
        self._counters[(pid, name)] = dict(values)
        self._write({"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": self._ts(abs_us),
                     "args": values})

    def instant(self, name: str, abs_us: int, args: dict | None = None,
                pid: int = CONTROLLER_PID) -> None:
        self._write({"ph": "i", "s": "g", "name": name, "pid": pid, "tid": 0,
                     "ts": self._ts(abs_us), "args": args or {}})

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        """Finish the file, and wait for the segments still being compressed."""
        if self._f is None:
            return
        self._f.write("\n]\n")
        self._f.close()
        self._f = None
        for t in self._compressing:
            t.join()
        self._compressing = []


def _compress(path: Path) -> None:
    """A rotated segment compressed (on its thread); a full disk leaves it uncompressed (readers take both)."""
    try:
        compress(path)
    except OSError as e:
        log.warning("trace segment %s was not compressed (%s); it stays uncompressed", path, e)


def load_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Events of a trace file (or a `.gz` segment): array format (closed or not, as a crashed run
    leaves it) or the object format {"traceEvents": [...]}. A torn last line is skipped."""
    with open_text(path) as f:
        text = f.read().strip()
    if not text:
        return []
    if text.startswith("{"):
        return list(json.loads(text).get("traceEvents", []))
    try:
        return list(json.loads(text))
    except json.JSONDecodeError:
        pass
    events = []
    for line in text.lstrip("[").splitlines():
        line = line.strip().rstrip(",").rstrip("]").strip()
        if not line:
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line a crash cut in half
    return events


def load_recent_trace(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """RUN_DIR/trace.json's events, after those of the segment before it when the controller that
    writes it rotated it (its `trace_segment` event names that file: one segment's worth at least,
    two at most). No trace.json: no events."""
    path = Path(run_dir) / "trace.json"
    if not path.exists():
        return []
    events = load_trace(path)
    head = next((e for e in events[:1] if e.get("ph") == "M" and e.get("name") == SEGMENT_META), None)
    previous = (head or {}).get("args", {}).get("previous")
    number = previous.split(".")[1] if previous and previous.count(".") >= 2 else ""  # trace.N.json.gz
    for _ in range(2):  # its compression may end (the uncompressed file removed) as it is looked up
        candidate = numbered(path).get(int(number)) if number.isdigit() else None
        if candidate is None:
            break
        try:
            return load_trace(candidate) + events
        except FileNotFoundError:
            continue
    return events


def track_names(events: list[dict[str, Any]]) -> dict[int, str]:
    """Trace pid -> process name ("rollout/0", "controller")."""
    return {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
