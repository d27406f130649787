"""Draw a live state (live_state.py) for people: one plain log line, or a rich panel.

Shared by the live view of `flowrl run` and by `flowrl status`, so both always agree. The plain
line is written for logs that get grepped:

    [flowrl] step 12/100 v12 | 1m21s | reward 0.412 | 5.3k tok/s (1.8k/dev) | staleness<=1 |
    busy prompts 1% rollout x2 92% reward 4% actor 40% | q rollout->reward=3 | restarts 0

rich is imported only inside `rich_view` (node processes never pay for it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

STALE_S = 5.0  # a node silent longer than this is shown as silent


@dataclass(frozen=True)
class GraphSummary:
    """What the view knows about the graph before any metric arrives."""

    name: str = "run"
    nodes: dict[str, int] = field(default_factory=dict)  # node -> replicas
    edges: tuple[str, ...] = ()  # "src->dst"
    total_steps: int | None = None
    devices: int | None = None

    @classmethod
    def coerce(cls, obj: Any) -> GraphSummary:
        """Accept a GraphSummary, a dict with these keys, an object with these attributes, or None."""
        if obj is None or isinstance(obj, GraphSummary):
            return obj or cls()
        get = obj.get if isinstance(obj, dict) else (lambda k, d=None: getattr(obj, k, d))
        nodes = get("nodes", {}) or {}
        if not isinstance(nodes, dict):
            nodes = {str(n): 1 for n in nodes}
        return cls(name=str(get("name", "run") or "run"), nodes={str(k): int(v) for k, v in nodes.items()},
                   edges=tuple(str(e) for e in (get("edges", ()) or ())),
                   total_steps=get("total_steps", None), devices=get("devices", None))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "nodes": dict(self.nodes), "edges": list(self.edges),
                "total_steps": self.total_steps, "devices": self.devices}


def fmt_num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    a = abs(x)
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if a >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def fmt_reward(x: float | None) -> str:
    """Rewards are compared digit by digit (0.962 vs 0.970): always three decimals."""
    return "-" if x is None else (f"{x:.3f}" if abs(x) < 1000 else fmt_num(x))


def fmt_bytes(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{int(x)}B"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def _health(n: dict[str, Any]) -> str:
    if not n.get("replicas"):
        return "starting"  # launched (node_up 0) but no snapshot yet
    if n.get("up") is False:
        return "DOWN"
    if (n.get("silent_s") or 0) > STALE_S:
        return f"silent {fmt_time(n['silent_s'])}"
    return "up"


def node_rows(state: dict[str, Any], graph: GraphSummary) -> list[dict[str, Any]]:
    """Nodes from the state, plus graph nodes that have not reported yet."""
    nodes = {n["node"]: n for n in state.get("nodes", [])}
    for name, replicas in graph.nodes.items():
        nodes.setdefault(name, {"node": name, "replicas": 0, "expected": replicas})
    for name, n in nodes.items():
        n.setdefault("expected", graph.nodes.get(name))
    order = list(graph.nodes) + sorted(k for k in nodes if k not in graph.nodes)
    return [nodes[k] for k in order]


def _edge_key(label: str) -> str:
    """"critic.out -> actor.in" and "critic->actor" name one edge: compare without ports/spaces."""
    return re.sub(r"\.[A-Za-z0-9_]+", "", label).replace(" ", "")


def edge_rows(state: dict[str, Any], graph: GraphSummary) -> list[dict[str, Any]]:
    """Edges in the graph's order (pipeline order as written), unknown ones after, by name."""
    rank = {_edge_key(e): i for i, e in enumerate(graph.edges)}
    return sorted(state.get("edges", []),
                  key=lambda e: (rank.get(_edge_key(e["edge"]), len(rank)), e["edge"]))


def plain_line(state: dict[str, Any], graph: Any = None) -> str:
    """One log line, about 170 characters for six nodes: progress, reward, throughput, each
    node's busy share of the last seconds (`blocked` when it waits for credit: the node after it
    is slower), nodes that are not up grouped by health, queue depths, restarts."""
    graph = GraphSummary.coerce(graph or state.get("graph"))
    total = f"/{graph.total_steps}" if graph.total_steps else ""
    parts = [f"[flowrl] step {state.get('step') if state.get('step') is not None else '-'}{total}"
             + (f" v{state['policy_version']}" if state.get("policy_version") is not None else ""),
             fmt_time(state.get("elapsed_s")),
             f"reward {fmt_reward(state.get('reward_mean'))}",
             f"{fmt_num(state.get('tokens_per_s'))} tok/s "
             f"({fmt_num(state.get('tokens_per_s_per_device'))}/dev)",
             f"staleness<={fmt_num(state.get('staleness_max'))}"]
    segs, unwell = [], {}
    for n in node_rows(state, graph):
        name = n["node"] + (f" x{n['replicas']}" if (n.get("replicas") or 0) > 1 else "")
        health = _health(n)
        if health != "up":  # grouped: "starting prompts rollout", "DOWN critic"
            unwell.setdefault(health, []).append(name)
            continue
        seg = f"{name} {fmt_pct(n.get('busy_ratio'))}"
        if (n.get("wait_credit_ratio") or 0) >= 0.2:
            seg += f" (blocked {fmt_pct(n['wait_credit_ratio'])})"
        segs.append(seg)
    if segs:
        parts.append("busy " + " ".join(segs))
    parts += [f"{health} {' '.join(names)}" for health, names in unwell.items()]
    queues = [f"{e['edge']}={fmt_num(e['queue_depth'])}" for e in edge_rows(state, graph)
              if e.get("queue_depth") is not None]
    if queues:
        parts.append("q " + " ".join(queues))
    restarted = [f"{n['node']} {n['restarts']}" for n in state.get("nodes", []) if n.get("restarts")]
    parts.append(f"restarts {state.get('restarts', 0)}" + (f" ({', '.join(restarted)})" if restarted else ""))
    parts += [f"replanned {text}" for text in state.get("replanned") or []]
    return " | ".join(parts)


def _bar(ratio: float | None, width: int = 5) -> str:
    if ratio is None:
        return "-"
    full = round(max(0.0, min(1.0, ratio)) * width)
    return "█" * full + "░" * (width - full) + f"{100 * ratio:4.0f}%"


def rich_view(state: dict[str, Any], graph: Any = None, title: str | None = None) -> Any:
    """A rich renderable: header line, a node table and an edge table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    graph = GraphSummary.coerce(graph or state.get("graph"))
    total = f"/{graph.total_steps}" if graph.total_steps else ""
    head = Text.assemble(
        (f"flowrl · {graph.name}", "bold"), "   ",
        ("step ", "dim"), f"{state.get('step') if state.get('step') is not None else '-'}{total}",
        ("   policy v", "dim"), f"{fmt_num(state.get('policy_version'))}",
        ("   elapsed ", "dim"), fmt_time(state.get("elapsed_s")), "\n",
        ("reward ", "dim"), (fmt_reward(state.get("reward_mean")), "bold green"),
        "   ", f"{fmt_num(state.get('tokens_per_s'))} tok/s "
        f"({fmt_num(state.get('tokens_per_s_per_device'))}/device)",
        ("   staleness ", "dim"), f"max {fmt_num(state.get('staleness_max'))}",
        ("   restarts ", "dim"), str(state.get("restarts", 0)))
    parts: list[Any] = [Text(title, style="bold")] if title else []
    parts.append(head)
    for text in state.get("replanned") or []:
        parts.append(Text.assemble(("replanned ", "bold yellow"), text))
    rows = node_rows(state, graph)
    gpu = any(n.get("gpu_utilization_percent") is not None for n in rows)
    nodes = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 1, 0, 0))
    # no "current state" column: a node's metrics go out from its event loop, i.e. only between
    # two batches, so the state they carry is nearly always a wait; the shares below are exact
    cols = ["node", "rep", "health", "busy", "starved", "blocked", "cpu", "mem"]
    cols += ["gpu", "frag"] if gpu else []
    for col in cols + ["restarts"]:
        nodes.add_column(col, no_wrap=col != "node",
                         justify="left" if col in ("node", "busy", "health") else "right")
    for n in rows:
        health = _health(n)
        exp = n.get("expected")
        cells = [
            n["node"], f"{n.get('replicas', 0)}" + (f"/{exp}" if exp else ""),
            Text(health, style="red" if health == "DOWN" else ("yellow" if health != "up" else "green")),
            _bar(n.get("busy_ratio")), fmt_pct(n.get("wait_input_ratio")),
            fmt_pct(n.get("wait_credit_ratio")),
            "-" if n.get("cpu_percent") is None else f"{n['cpu_percent']:.0f}%",
            fmt_bytes(n.get("rss_bytes"))]
        if gpu:
            cells += ["-" if n.get("gpu_utilization_percent") is None
                      else f"{n['gpu_utilization_percent']:.0f}%", fmt_pct(n.get("memory_fragmentation"))]
        nodes.add_row(*cells, str(n.get("restarts", 0)))
    parts.append(nodes)
    edges = edge_rows(state, graph)
    if edges:
        et = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 1, 0, 0))
        for col in ("edge", "queue", "msgs/s", "bytes/s", "bytes total"):
            et.add_column(col, justify="left" if col == "edge" else "right")
        for e in edges:
            et.add_row(e["edge"], fmt_num(e.get("queue_depth")), fmt_num(e.get("channel_messages_per_s")),
                       fmt_bytes(e.get("channel_bytes_per_s")), fmt_bytes(e.get("channel_bytes")))
        parts.append(et)
    return Group(*parts)
