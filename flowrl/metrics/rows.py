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

Span ratios (`actor/busy_ratio`, `critic/wait_input_ratio`, ...) are the one exception to "what
was reported in this step": a node reports every ~0.5 s, so a 0.2 s step would see a node's work
either three times or not at all. They cover the trailing max(ratio_window_s, step time) of each
process instead (MetricsHub.node_ratios), made exclusive (exclusive_ratios).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from flowrl.metrics.kinds import Gauge, Reduction, finite
from flowrl.metrics.recorder import BUSY_SPANS, SPAN_METRIC

#: Keys every row has, first and in this order (the run-directory contract, DESIGN.md section 10).
REQUIRED = ("step", "wall_s", "reward_mean", "samples", "tokens", "policy_version", "staleness_max")
LEADING = REQUIRED + ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "samples_per_s",
                      "devices")


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


def exclusive_ratios(raw: dict[str, float]) -> dict[str, float]:
    """One process's span shares, made exclusive: a process is in one state at a time, work
    outranks waiting. An input task that sits in `wait_input` while the main task computes (one
    thread, two asyncio tasks) would otherwise count the same second twice, so waits are capped
    by what work left over: wait_credit <= 1 - busy, wait_input <= 1 - busy - wait_credit."""
    r = {s: min(1.0, max(0.0, v)) for s, v in raw.items()}
    left = 1.0 - busy_of(r)
    for s in sorted(r):
        if s.startswith("wait_") and s != "wait_input":
            r[s] = min(r[s], max(0.0, left))
            left -= r[s]
    if "wait_input" in r:
        r["wait_input"] = min(r["wait_input"], max(0.0, left))
    return r


def busy_of(ratios: dict[str, float]) -> float:
    return min(1.0, sum(ratios.get(s, 0.0) for s in BUSY_SPANS))


def ratio_keys(node: str, per_replica: list[dict[str, float]]) -> dict[str, float]:
    """`{node}/{span}_ratio`, `{node}/busy_ratio` (compute + weight_sync + weight_snapshot) and
    `{node}/idle_ratio` = 1 - busy, averaged over the node's replicas."""
    if not per_replica:
        return {}
    n = len(per_replica)
    out = {f"{node}/{span}_ratio": sum(r.get(span, 0.0) for r in per_replica) / n
           for span in sorted(set().union(*per_replica))}
    busy = sum(busy_of(r) for r in per_replica) / n
    out[f"{node}/busy_ratio"] = busy
    out[f"{node}/idle_ratio"] = 1.0 - busy
    return out


def row_plan(series: Iterable[Any]) -> list[tuple[str, list, dict[str, str], tuple]]:
    """How `build_row` groups `series` into keys: [(kind, member series, {suffix: row key}, (node or
    None, name, labels))], the keys filled in as they are first needed. The same as long as the set
    of series is (the hub makes it again when a series comes or goes)."""
    groups: dict[tuple, list] = defaultdict(list)
    for s in series:
        if s.name == SPAN_METRIC and s.scope == "node" and s.kind == "sum":
            continue  # span seconds become ratios (below) and Prometheus counters, not columns
        groups[(s.node if s.scope == "node" else None, s.name, s.kind, s.labels)].append(s)
    return [(kind, members, {}, (node, name, labels)) for (node, name, kind, labels), members in groups.items()]


def build_row(series: Iterable[Any], ratios: dict[tuple[str, int], dict[str, float]],
              plan: list | None = None) -> dict[str, Any]:
    """The metric keys of one row from every hub Series' window, plus each node's span ratios
    from `ratios` ({(node, replica): {span: share}}, see MetricsHub.node_ratios). `plan`:
    `row_plan(series)`, kept from an earlier row (per step, grouping and naming were most of the cost)."""
    row: dict[str, Any] = {}
    for kind, members, keys, (node, name, labels) in (row_plan(series) if plan is None else plan):
        # one series (most groups): its window as it is, since summarising only reads it
        value = members[0].window if len(members) == 1 else reduce_values(m.window for m in members)
        for suffix, v in summarize(kind, value).items():
            key = keys.get(suffix)
            if key is None:
                key = keys[suffix] = row_key(node, name, suffix, labels)
            put(row, key, v)
    by_node: dict[str, list] = defaultdict(list)
    for (node, _), r in sorted(ratios.items()):
        by_node[node].append(r)
    for node, per_replica in by_node.items():
        row.update(ratio_keys(node, per_replica))
    return row


def order_row(row: dict, memo: dict | None = None) -> dict:
    """Contract keys first, the rest sorted; non-finite numbers become null (valid JSON). `memo`: a
    dict kept between rows, which holds the last order (rows of one run mostly share their keys)."""
    if memo is not None and memo.get("keys") == row.keys():
        order = memo["order"]
    else:
        leading = set(LEADING)
        order = [*LEADING, *sorted(k for k in row if k not in leading)]
        if memo is not None:
            memo["keys"], memo["order"] = set(row), order
    get = row.get
    return {k: (finite(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
            for k in order for v in (get(k),)}
