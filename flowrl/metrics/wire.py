"""The metrics snapshot a node sends to the controller — its schema, written down once, and the
bounded check the controller runs on it before believing a single number.

    {"v": 1, "node": "rollout", "replica": 0, "pid": 4242, "host": "h1", "t": 1718000000.5,
     "since": 1718000000.0, "seq": 17, "state": "compute",
     "metrics": [[name, kind, {label: value}, per_node, payload], ...],   # kinds.py payloads
     "spans":   [[tid, name, start_us (epoch), dur_us, {arg: value}], ...],
     "threads": {"<tid>": "MainThread"}, "dropped_spans": 0}

`since` .. `t` is the time the snapshot covers (the previous drain to this one, epoch seconds);
it is optional, so older nodes still parse, and is what per-node busy ratios are divided by.

Snapshots arrive over a socket, so they are untrusted: sizes are capped, types checked, and a bad
one raises `SnapshotError` naming the field — the controller counts it and keeps running.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowrl.metrics.kinds import KINDS, Reduction
from flowrl.metrics.recorder import NAME_RE, WIRE_VERSION

MAX_METRICS = 10_000
MAX_SPANS = 200_000
MAX_LABELS = 8
MAX_STR = 200


class SnapshotError(ValueError):
    """A metrics snapshot that does not follow the schema above."""


@dataclass
class Metric:
    name: str
    kind: str
    labels: tuple[tuple[str, str], ...]
    per_node: bool
    value: Reduction


@dataclass
class Snapshot:
    node: str
    replica: int
    pid: int
    host: str
    t: float
    seq: int
    state: str
    since: float | None = None
    metrics: list[Metric] = field(default_factory=list)
    spans: list[tuple[int, str, int, int, dict]] = field(default_factory=list)
    threads: dict[int, str] = field(default_factory=dict)
    dropped_spans: int = 0


def _str(obj: Any, what: str) -> str:
    if not isinstance(obj, str) or len(obj) > MAX_STR:
        raise SnapshotError(f"{what} must be a string of at most {MAX_STR} chars, got {obj!r:.80}")
    return obj


def _int(obj: Any, what: str) -> int:
    if isinstance(obj, bool) or not isinstance(obj, int):
        raise SnapshotError(f"{what} must be an integer, got {obj!r:.80}")
    return obj


def _num(obj: Any, what: str) -> float:
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        raise SnapshotError(f"{what} must be a number, got {obj!r:.80}")
    return obj


def _name(obj: Any, what: str) -> str:
    if type(obj) is str and obj in _NAMES:
        return obj
    if not isinstance(obj, str) or not NAME_RE.match(obj):
        raise SnapshotError(f"{what} {obj!r:.80} is not a metric name (letters, digits, '_')")
    if len(_NAMES) < MAX_NAMES:
        _NAMES.add(obj)
    return obj


_NAMES: set[str] = set()  # names that passed the check (the same few in every snapshot), at most MAX_NAMES
MAX_NAMES = 10_000
_FIELDS = {"sum": ("value",), "mean": ("total", "weight"), "max": ("value?",),
           "min": ("value?",), "gauge": ("value?", "t"), "hist": ("total", "count", "lo?", "hi?")}


def _check_numbers(value: Reduction) -> None:
    """Every field a kind will add or compare must be a number (None where a kind allows it)."""
    for f in _FIELDS[value.kind]:
        v = getattr(value, f.rstrip("?"))
        if v is None and f.endswith("?"):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"field {f.rstrip('?')} must be a number, got {v!r:.40}")
    if value.kind == "hist":
        if len(value.bounds) > 200:
            raise ValueError(f"{len(value.bounds)} histogram buckets; at most 200")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in value.counts):
            raise ValueError("histogram counts must be non-negative integers")


def _short_lists(payload: list) -> bool:
    for p in payload:
        if isinstance(p, list) and len(p) > 256:
            return False
    return True


def parse_snapshot(obj: Any) -> Snapshot:
    if not isinstance(obj, dict):
        raise SnapshotError(f"snapshot must be a map, got {type(obj).__name__}")
    if obj.get("v") != WIRE_VERSION:
        raise SnapshotError(f"snapshot version {obj.get('v')!r} is not {WIRE_VERSION}; node and "
                            f"controller run different flowrl versions")
    snap = Snapshot(node=_str(obj.get("node"), "node"), replica=_int(obj.get("replica"), "replica"),
                    pid=_int(obj.get("pid"), "pid"), host=_str(obj.get("host"), "host"),
                    t=_num(obj.get("t"), "t"), seq=_int(obj.get("seq", 0), "seq"),
                    state=_str(obj.get("state", "idle"), "state"),
                    since=None if obj.get("since") is None else _num(obj.get("since"), "since"),
                    dropped_spans=_int(obj.get("dropped_spans", 0), "dropped_spans"))
    metrics, spans, threads = obj.get("metrics", []), obj.get("spans", []), obj.get("threads", {})
    if not isinstance(metrics, list) or len(metrics) > MAX_METRICS:
        raise SnapshotError(f"metrics must be a list of at most {MAX_METRICS} entries")
    if not isinstance(spans, list) or len(spans) > MAX_SPANS:
        raise SnapshotError(f"spans must be a list of at most {MAX_SPANS} entries")
    if not isinstance(threads, dict) or len(threads) > 1000:
        raise SnapshotError("threads must be a map of at most 1000 entries")
    for i, m in enumerate(metrics):
        if not isinstance(m, list) or len(m) != 5:
            raise SnapshotError(f"metrics[{i}] must be [name, kind, labels, per_node, payload]")
        name, kind, labels, per_node, payload = m
        _name(name, f"metrics[{i}] name")
        if kind not in KINDS:
            raise SnapshotError(f"metrics[{i}] ({name}) has kind {kind!r}; known: {sorted(KINDS)}")
        if not isinstance(labels, dict) or len(labels) > MAX_LABELS:
            raise SnapshotError(f"metrics[{i}] ({name}) labels must be a map of <= {MAX_LABELS}")
        lab = tuple(sorted((_name(k, "label"), _str(v, f"label {k}")) for k, v in labels.items())) if labels else ()
        if not isinstance(payload, list) or len(payload) > 8 or not _short_lists(payload):
            raise SnapshotError(f"metrics[{i}] ({name}) payload must be a short list")
        try:
            value = KINDS[kind].from_wire(payload)
            _check_numbers(value)
        except (TypeError, ValueError) as e:
            raise SnapshotError(f"metrics[{i}] ({name}, {kind}) payload {payload!r:.80}: {e}") from e
        snap.metrics.append(Metric(name, kind, lab, bool(per_node), value))
    for i, s in enumerate(spans):
        if not isinstance(s, list) or len(s) != 5 or not isinstance(s[4], dict):
            raise SnapshotError(f"spans[{i}] must be [tid, name, start_us, dur_us, args]")
        tid, name, start, dur = (_int(s[0], "span tid"), _name(s[1], "span name"),
                                 _int(s[2], "span start"), _int(s[3], "span duration"))
        if dur < 0:
            raise SnapshotError(f"spans[{i}] ({name}) has negative duration {dur} us")
        args = s[4]
        if args:
            args = {str(k)[:50]: v for k, v in list(args.items())[:16]
                    if isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= MAX_STR)}
        snap.spans.append((tid, name, start, dur, args))
    for tid, name in threads.items():
        try:
            snap.threads[int(tid)] = _str(name, "thread name")
        except ValueError as e:
            raise SnapshotError(f"threads key {tid!r} is not an integer thread id") from e
    return snap
