"""Where did the pipeline wait? Busy and idle time per node from trace.json, and what to change.

A node is *busy* while it computes or syncs weights, and waits otherwise: for input (starved by
the node before it), for credit (blocked by back-pressure from the node after it) or untracked.
In a pipeline the busiest node sets the pace — the bottleneck — and the nodes around it show
the mirror image: downstream nodes wait for input, upstream ones wait for credit. Ratios are
over the whole run's window (first to last node span), so a node that started late or died early
counts as idle for the time it was not there.

    uses = node_utilisation(load_trace(run_dir / "trace.json"))
    b, advice = diagnose(uses)    # "rollout", "rollout is busy 92% while actor waits for input 60%: ..."
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from flowrl.metrics.rows import BUSY_SPANS
from flowrl.metrics.trace import track_names


@dataclass
class NodeUse:
    node: str
    replicas: int
    seconds: dict[str, float]  # span -> seconds summed over replicas
    window_s: float

    def ratio(self, span: str) -> float:
        return min(1.0, self.seconds.get(span, 0.0) / max(1e-9, self.window_s * self.replicas))

    @property
    def busy(self) -> float:
        return min(1.0, sum(self.ratio(s) for s in BUSY_SPANS))

    @property
    def idle(self) -> float:
        return 1.0 - self.busy


def node_utilisation(events: list[dict[str, Any]]) -> dict[str, NodeUse]:
    """Per node (replicas aggregated): seconds in each span over the common run window."""
    names = track_names(events)
    spans = [e for e in events if e.get("ph") == "X" and names.get(e.get("pid"), "controller")
             != "controller"]
    if not spans:
        return {}
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e.get("dur", 0) for e in spans)
    window = max(1e-9, (t1 - t0) / 1e6)
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    replicas: dict[str, set[str]] = defaultdict(set)
    for pid, name in names.items():
        if name != "controller":
            node, _, rep = name.rpartition("/")
            replicas[node or name].add(rep)
    for e in spans:
        node, _, _ = names[e["pid"]].rpartition("/")
        seconds[node][e["name"]] += e.get("dur", 0) / 1e6
    return {node: NodeUse(node, max(1, len(replicas[node])), dict(seconds[node]), window)
            for node in sorted(seconds)}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def diagnose(uses: dict[str, NodeUse]) -> tuple[str | None, str]:
    """(bottleneck node, one concrete suggestion) from per-node utilisation."""
    if not uses:
        return None, ("the trace has no node spans, so there is nothing to diagnose; nodes record "
                      "spans with Recorder.span('compute') etc.")
    b = max(uses.values(), key=lambda u: (u.busy, u.node))
    others = [u for u in uses.values() if u.node != b.node]
    # the busier a waiting node is otherwise, the more it matters that it waits: name it first
    starved = sorted((u for u in others if u.ratio("wait_input") >= 0.1),
                     key=lambda u: (-u.busy, u.node))[:3]
    blocked = max(others, key=lambda u: u.ratio("wait_credit"), default=None)
    if b.busy < 0.5:
        return b.node, (f"no node is busy even half of the time (busiest: {b.node} {_pct(b.busy)}): "
                        f"the pipeline is latency-bound, not compute-bound; raise max_staleness so "
                        f"stages overlap, or give each ticket more prompts")
    why = f"{b.node} is busy {_pct(b.busy)}"
    if starved:
        why += " while " + ", ".join(
            f"{u.node} waits for input {_pct(u.ratio('wait_input'))}" if i == 0 else
            f"{u.node} {_pct(u.ratio('wait_input'))}" for i, u in enumerate(starved))
    if blocked is not None and blocked.ratio("wait_credit") >= 0.1:
        why += (f"{' and' if 'while' in why else ' while'} {blocked.node} waits for credit "
                f"{_pct(blocked.ratio('wait_credit'))}")
    reps = f"{b.replicas} replica{'s' if b.replicas != 1 else ''}"
    sync = b.ratio("weight_sync")
    if sync >= 0.25 * b.busy:
        fix = (f"weight sync is {_pct(sync)} of {b.node}'s time: sync less often (raise "
               f"max_staleness), use larger buckets, or place {b.node} and rollout on "
               f"NVLink-connected devices")
    elif "rollout" in b.node:
        fix = (f"give {b.node} more devices (it runs {reps}; rollout is usually given 1/3 to 1/2 "
               f"of the actor's devices) or raise max_staleness so generation overlaps training")
    elif blocked is not None and blocked.ratio("wait_credit") >= 0.1:
        fix = (f"give {b.node} more devices (it runs {reps}), or move devices from "
               f"{blocked.node}, which is held back by back-pressure, to {b.node}")
    else:
        fix = f"give {b.node} more devices or replicas (it runs {reps}), or make its work smaller"
    return b.node, f"{why}: {fix}"


def utilisation_table(uses: dict[str, NodeUse]) -> list[str]:
    cols = ("busy", "compute", "weight_sync", "wait_input", "wait_credit", "idle")
    lines = [f"{'node':<14}{'replicas':>9}" + "".join(f"{c:>13}" for c in cols)]
    for u in uses.values():
        vals = [u.busy, u.ratio("compute"), u.ratio("weight_sync"), u.ratio("wait_input"),
                u.ratio("wait_credit"), u.idle]
        lines.append(f"{u.node:<14}{u.replicas:>9}" + "".join(f"{_pct(v):>13}" for v in vals))
    return lines
