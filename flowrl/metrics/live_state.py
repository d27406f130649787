"""The live state of a run as one JSON-able dict — what the terminal view draws and what the
controller writes to RUN_DIR/status.json for `flowrl status` (same data, same renderer).

    {"step": 12, "elapsed_s": 81.2, "reward_mean": 0.41, "tokens_per_s": 5300.0, ...,
     "nodes": [{"node": "rollout", "replicas": 2, "up": true, "states": {"compute": 2},
                "busy_ratio": 0.92, "wait_input_ratio": 0.0, "cpu_percent": 97.0,
                "rss_bytes": 1.2e9, "restarts": 0, "silent_s": 0.4, ...}],
     "edges": [{"edge": "rollout->reward", "queue_depth": 3, "channel_bytes": 1.1e8,
                "channel_bytes_per_s": 2.2e6, ...}],
     "restarts": 0, "rejected_snapshots": 0}

Node rows aggregate replicas (busy and CPU averaged, memory summed, the worst fragmentation),
so the view stays one line per node however many replicas run; `replica_detail` keeps each one.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from flowrl.metrics.rows import busy_of

if TYPE_CHECKING:
    from flowrl.metrics.hub import MetricsHub

SUMMARY_KEYS = ("step", "policy_version", "reward_mean", "tokens_per_s", "tokens_per_s_per_device",
                "samples_per_s", "step_time_s", "staleness_max")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def build_live_state(hub: MetricsHub, now: float) -> dict[str, Any]:
    row = hub.last_row or {}
    state: dict[str, Any] = {"v": 1, "t": now, "elapsed_s": hub._wall_offset + now - hub.t0,
                             "devices": hub.devices}
    # a step whose window saw no reward still shows the last reward anyone reported
    state.update({k: row.get(k) if row.get(k) is not None else hub.last_known.get(k)
                  for k in SUMMARY_KEYS})
    gauges: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    node_up: dict[str, list[float]] = defaultdict(list)
    restarts: dict[str, float] = defaultdict(float)
    edges: dict[str, dict[str, float]] = defaultdict(dict)
    for s in hub._series.values():
        labels = dict(s.labels)
        if s.kind == "gauge" and s.window is not None and s.window.value is not None:
            if s.replica is not None and s.node is not None and s.scope == "node":
                gauges[(s.node, s.replica)][s.name].append(s.window.value)
            if s.name == "node_up" and s.node is not None:
                node_up[s.node].append(s.window.value)
        if s.name == "restarts" and s.kind == "sum" and s.node is not None and s.total is not None:
            restarts[s.node] += s.total.value
        if "edge" in labels:
            e = edges[labels["edge"]]
            if s.kind == "gauge" and s.window is not None and s.window.value is not None:
                e[s.name] = e.get(s.name, 0) + s.window.value
            elif s.kind == "sum" and s.total is not None:
                e[s.name] = e.get(s.name, 0) + s.total.value
                rate = hub.rate(s)  # trailing seconds: nodes report every ~0.5 s, steps are shorter
                if rate is not None:
                    e[f"{s.name}_per_s"] = e.get(f"{s.name}_per_s", 0) + rate

    live_ratios = hub.node_ratios()  # trailing seconds, not the last step (see hub.py)
    by_node: dict[str, list] = defaultdict(list)
    for (node, replica), rep in sorted(hub.reporters.items()):
        if node != "controller":
            by_node[node].append(rep)
    nodes = []
    for node in sorted(set(by_node) | set(node_up) | set(restarts)):
        reps = by_node.get(node, [])
        detail = []
        for rep in reps:
            g = gauges.get((node, rep.replica), {})
            ratios = live_ratios.get((node, rep.replica), {})
            detail.append({
                "replica": rep.replica, "pid": rep.pid, "host": rep.host, "state": rep.state,
                "silent_s": max(0.0, now - rep.seen_t),
                "busy_ratio": busy_of(ratios) if ratios else None,
                **{f"{span}_ratio": r for span, r in ratios.items()},
                "cpu_percent": _mean(g.get("cpu_percent", [])),
                "rss_bytes": _mean(g.get("rss_bytes", [])),
                "gpu_utilization_percent": _mean(g.get("gpu_utilization_percent", [])),
                "gpu_memory_bytes": sum(g.get("gpu_process_memory_bytes", [])) or None,
                "memory_fragmentation": max(g.get("memory_fragmentation", []), default=None),
            })

        def agg(key: str, how: Any = _mean) -> Any:
            vals = [d[key] for d in detail if d.get(key) is not None]
            return how(vals) if vals else None

        entry = {"node": node, "replicas": len(reps),
                 "up": (min(node_up[node]) >= 1) if node_up.get(node) else None,
                 "states": dict(Counter(d["state"] for d in detail)),
                 "restarts": int(restarts.get(node, 0)),
                 "silent_s": agg("silent_s", max), "busy_ratio": agg("busy_ratio"),
                 "cpu_percent": agg("cpu_percent"), "rss_bytes": agg("rss_bytes", sum),
                 "gpu_utilization_percent": agg("gpu_utilization_percent"),
                 "gpu_memory_bytes": agg("gpu_memory_bytes", sum),
                 "memory_fragmentation": agg("memory_fragmentation", max),
                 "replica_detail": detail}
        for span in ("wait_input", "wait_credit", "weight_sync", "compute"):
            entry[f"{span}_ratio"] = agg(f"{span}_ratio")
        nodes.append(entry)
    state["nodes"] = nodes
    state["edges"] = [{"edge": name, **vals} for name, vals in sorted(edges.items())]
    state["restarts"] = int(sum(restarts.values()))
    state["rejected_snapshots"] = hub.rejected
    state["replanned"] = list(getattr(hub, "replans", []))[-3:]
    return state
