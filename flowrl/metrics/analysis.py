"""Where did the pipeline wait? Busy and idle time per node from trace.json, and what to change.

A node is *busy* while it computes or syncs weights, and waits otherwise: for input (starved by
the node before it), for credit (blocked by back-pressure from the node after it) or untracked.
In a pipeline the busiest node sets the pace — the bottleneck — and the nodes around it show
the mirror image: downstream nodes wait for input, upstream ones wait for credit. Ratios are
over the whole run's window (first to last node span), so a node that started late or died early
counts as idle for the time it was not there. Each process is in one state at a time
(`exclusive_segments`): where its spans overlap, work outranks waiting.

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
    seconds: dict[str, float]  # state -> seconds summed over replicas (exclusive states)
    window_s: float

    def ratio(self, span: str) -> float:
        return min(1.0, self.seconds.get(span, 0.0) / max(1e-9, self.window_s * self.replicas))

    @property
    def busy(self) -> float:
        return min(1.0, sum(self.ratio(s) for s in BUSY_SPANS))

    @property
    def idle(self) -> float:
        return 1.0 - self.busy

    @property
    def sync(self) -> float:
        """Weight sync, with the publisher's snapshot of its weights into the send buckets."""
        return min(1.0, self.ratio("weight_sync") + self.ratio("weight_snapshot"))


def _rank(name: str) -> int:
    """Which state wins where spans of one process overlap: work, then blocked, then starved."""
    if name in BUSY_SPANS:
        return 0
    return 2 if name == "wait_input" else 1


STATES = (*BUSY_SPANS, "wait_credit", "wait_input")


def exclusive_segments(spans: list[dict[str, Any]]) -> list[tuple[int, int, str]]:
    """One process's spans as (start_us, end_us, state) with no overlap, in time order. A process
    is in one state at a time; where spans overlap (an input task waits while the main task
    computes: two asyncio tasks, one thread) work outranks waiting for credit, which outranks
    waiting for input. Spans with other names (a node's own, usually inside compute) are left
    out; time in none of the states is untracked."""
    points: list[tuple[int, int, str]] = []
    for e in spans:
        name = e.get("name")
        if name in STATES and e.get("dur", 0) > 0:
            points.append((e["ts"], 1, name))
            points.append((e["ts"] + e["dur"], -1, name))
    points.sort(key=lambda p: (p[0], p[1]))
    active: dict[str, int] = defaultdict(int)
    out: list[tuple[int, int, str]] = []
    prev_t, prev_state = None, None
    for t, delta, name in points:
        if prev_state is not None and prev_t is not None and t > prev_t:
            if out and out[-1][2] == prev_state and out[-1][1] == prev_t:
                out[-1] = (out[-1][0], t, prev_state)
            else:
                out.append((prev_t, t, prev_state))
        active[name] += delta
        live = [n for n, c in active.items() if c > 0]
        prev_state = min(live, key=lambda n: (_rank(n), n)) if live else None
        prev_t = t
    return out


def process_segments(events: list[dict[str, Any]]) -> dict[int, list[tuple[int, int, str]]]:
    """Trace pid -> exclusive segments, for every node process (not the controller)."""
    names = track_names(events)
    spans: dict[int, list] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and names.get(e.get("pid"), "controller") != "controller":
            spans[e["pid"]].append(e)
    return {pid: exclusive_segments(s) for pid, s in spans.items()}


def node_utilisation(events: list[dict[str, Any]]) -> dict[str, NodeUse]:
    """Per node (replicas aggregated): seconds in each state over the common run window."""
    names = track_names(events)
    segments = {p: s for p, s in process_segments(events).items() if s}
    if not segments:
        return {}
    t0 = min(s[0][0] for s in segments.values())
    t1 = max(s[-1][1] for s in segments.values())
    window = max(1e-9, (t1 - t0) / 1e6)
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    replicas: dict[str, set[str]] = defaultdict(set)
    for pid, name in names.items():
        if name != "controller":
            node, _, rep = name.rpartition("/")
            replicas[node or name].add(rep)
    for pid, segs in segments.items():
        node = names[pid].rpartition("/")[0] or names[pid]
        for a, b, state in segs:
            seconds[node][state] += (b - a) / 1e6
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
    sync = b.sync
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


def ordered(uses: dict[str, NodeUse], order: list[str] | None = None) -> list[NodeUse]:
    """Nodes in graph order (`order`, e.g. from RUN_DIR/graph.yaml), the rest by name."""
    rank = {n: i for i, n in enumerate(order or [])}
    return sorted(uses.values(), key=lambda u: (rank.get(u.node, len(rank)), u.node))


def utilisation_table(uses: dict[str, NodeUse], order: list[str] | None = None) -> list[str]:
    cols = ("busy", "compute", "weight_sync", "wait_input", "wait_credit", "idle")
    lines = [f"{'node':<14}{'replicas':>9}" + "".join(f"{c:>13}" for c in cols)]
    for u in ordered(uses, order):
        vals = [u.busy, u.ratio("compute"), u.sync, u.ratio("wait_input"),
                u.ratio("wait_credit"), u.idle]
        lines.append(f"{u.node:<14}{u.replicas:>9}" + "".join(f"{_pct(v):>13}" for v in vals))
    return lines
