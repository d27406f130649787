"""How series become the keys of one metrics.jsonl row (and why the names look as they do).

One row per training step, flat, so `pandas.read_json(path, lines=True)` gives a usable table:

    run scope  (default)            reward_mean, samples, tokens, rollout_latency_s_p95,
                                    channel_bytes/rollout->reward
    node scope (per_node=True, or a controller metric labelled node=...)
                                    rollout/cpu_percent, critic/restarts, actor/compute_ratio

Suffix by kind: sum "" · mean "_mean" · max "_max" · min "_min" · gauge "" ·
histogram "_p50", "_p95", "_p99", "_mean", "_max", "_count". Labels other than node/replica are
appended as "/value" in label-name order. Run-scope names reduce over every replica of every node
that reports them; node-scope names over the replicas of that node. A series known from earlier
steps but silent in this one still gets its keys (sums 0, the rest null), so columns stay stable.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from flowrl.metrics.kinds import Gauge, Reduction, finite
from flowrl.metrics.recorder import SPAN_METRIC

#: Keys every row has, first and in this order (the run-directory contract, DESIGN.md section 10).
REQUIRED = ("step", "wall_s", "reward_mean", "samples", "tokens", "policy_version", "staleness_max")
LEADING = REQUIRED + ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "samples_per_s",
                      "devices")

#: Spans counted as the node being occupied; every other span (wait_input, wait_credit) is waiting.
BUSY_SPANS = ("compute", "weight_sync")

EMPTY: dict[str, dict[str, float | None]] = {
    "sum": {"": 0},
    "mean": {"_mean": None},
    "max": {"_max": None},
    "min": {"_min": None},
    "gauge": {"": None},
    "hist": {"_p50": None, "_p95": None, "_p99": None, "_mean": None, "_max": None, "_count": 0},
}


def row_key(scope_node: str | None, name: str, suffix: str,
            labels: Iterable[tuple[str, str]] = ()) -> str:
    prefix = f"{scope_node}/" if scope_node else ""
    return prefix + name + suffix + "".join(f"/{v}" for _, v in labels)


def reduce_values(values: Iterable[Reduction | None]) -> Reduction | None:
    """Combine one window of several series (replicas): sums add, means weight, max max,
    histograms add counts, gauges combine by their `across` rule."""
    acc: Reduction | None = None
    for v in values:
        if v is None:
            continue
        if acc is None:
            acc = v.copy()
            if isinstance(acc, Gauge):
                acc.n = 1
        elif isinstance(acc, Gauge):
            acc.combine(v)
        else:
            acc.merge(v)
    return acc


def summarize(kind: str, value: Reduction | None) -> dict[str, float | None]:
    got = value.summary() if value is not None else {}
    return got or dict(EMPTY[kind])


def put(row: dict, key: str, value: float | None) -> None:
    """Set a row key; when two kinds land on one key (a `max` and a histogram of the same name
    both give name_max) the extreme wins, so the column keeps its meaning."""
    old = row.get(key)
    if old is None or value is None:
        row[key] = value if value is not None else old
    elif key.endswith("_max"):
        row[key] = max(old, value)
    elif key.endswith("_min"):
        row[key] = min(old, value)
    else:
        row[key] = value


def span_ratio_keys(node: str, seconds: dict[str, float], replicas: int,
                    step_time_s: float) -> dict[str, float]:
    """`{node}/{span}_ratio` = seconds spent in the span per replica per second of step time,
    plus busy_ratio (compute + weight_sync) and idle_ratio = 1 - busy. Clamped to [0, 1]:
    a span that straddles a step boundary can land in the later step."""
    denom = max(replicas, 1) * max(step_time_s, 1e-9)
    ratios = {span: min(1.0, max(0.0, s / denom)) for span, s in sorted(seconds.items())}
    busy = min(1.0, sum(ratios.get(s, 0.0) for s in BUSY_SPANS))
    out = {f"{node}/{span}_ratio": r for span, r in ratios.items()}
    out[f"{node}/busy_ratio"] = busy
    out[f"{node}/idle_ratio"] = 1.0 - busy
    return out


def build_row(series: Iterable[Any], step_time_s: float, replicas: dict[str, int]
              ) -> tuple[dict[str, Any], dict[tuple[str, int], dict[str, float]]]:
    """The metric keys of one row from every hub Series' window, plus each node replica's
    span ratios ({(node, replica): {span: ratio}}). `replicas` = node -> replicas that reported
    in this window (the denominator of the node's ratios)."""
    row: dict[str, Any] = {}
    groups: dict[tuple, list] = defaultdict(list)
    spans: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    ratios: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for s in series:
        if s.name == SPAN_METRIC and s.scope == "node" and s.kind == "sum":
            span, seconds = dict(s.labels).get("span", "?"), s.window.value if s.window else 0.0
            spans[s.node][span] += seconds
            ratios[(s.node, s.replica)][span] = min(1.0, seconds / max(step_time_s, 1e-9))
            continue
        groups[(s.node if s.scope == "node" else None, s.name, s.kind, s.labels)].append(s)
    for (node, name, kind, labels), members in groups.items():
        value = reduce_values(m.window for m in members)
        for suffix, v in summarize(kind, value).items():
            put(row, row_key(node, name, suffix, labels), v)
    for node, seconds in spans.items():
        row.update(span_ratio_keys(node, seconds, replicas.get(node, 1), step_time_s))
    return row, dict(ratios)


def order_row(row: dict) -> dict:
    """Contract keys first, the rest sorted; non-finite numbers become null (valid JSON)."""
    out = {k: row.get(k) for k in LEADING}
    for k in sorted(k for k in row if k not in out):
        out[k] = row[k]
    return {k: (finite(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
            for k, v in out.items()}
