"""Where the cycles go: each process's CPU per training step, split into the model's compute and
the framework's time by category, from the CPU accounting in metrics.jsonl.

    rows = load_rows(run_dir / "metrics.jsonl")
    b = cpu_breakdown(rows, uses=node_utilisation(events))   # None for a run without the data
    print("\\n".join(breakdown_table(b, order)))

What the numbers are (per process; a node's replicas add up; ms per step = sum / steps, over the
steps up to the node's last CPU read, `steps` in its entry):

    compute    CPU of the compute thread inside `compute` spans (runner.py reads the thread's CPU
               clock where the span starts and ends), plus unnamed native threads (torch's
               intra-op pools)
    framework  every other CPU second of the process: the event loop's thread, the compute thread
               outside spans (weight snapshots and landing, checkpoints), heartbeat, ZeroMQ IO
               and gloo threads, the stack sampler, threads that ended. By category: the Python
               threads' CPU is split as sampled (loopprof.py, stacks.py), the others by what
               they are (ZeroMQ IO -> transport, gloo -> weight_sync, heartbeat -> control,
               sampler -> metrics); unsampled, the event loop is control, the rest other
    idle       wall time minus CPU: one core's worth of time the process left unused
    wait_input share of wall time in `wait_input` spans (from trace.json), a part of idle when
               the process is otherwise quiet

The first row is left out: it holds start-up, which the accounting does not cover (it begins when
a node is ready).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from flowrl.metrics.recorder import (CPU_PROCESS_METRIC, CPU_SAMPLED_METRIC, CPU_THREAD_METRIC,
                                     SPAN_CPU_METRIC)
from flowrl.metrics.stacks import CATEGORIES, UNSEEN

#: What the CPU of a thread role is when the stack sampler did not split it.
ROLE_CATEGORY = {"loop": "control", "compute": "other", "pythreads": "other", "heartbeat": "control",
                 "sampler": "metrics", "zmq": "transport", "gloo": "weight_sync", "native": "other"}


def _last_sampled(rows: list[dict[str, Any]]) -> dict[str, int]:
    """node -> index of the last row that carries a read of its threads' CPU. Spans come with each
    completed ticket while the threads are read on a timer (every ~0.2-0.5 s), so the rows after a
    node's last read hold spans whose thread CPU no row holds: its sums stop at that row."""
    last: dict[str, int] = {}
    for i, row in enumerate(rows):
        for key, value in row.items():
            node, _, rest = key.partition("/")
            if rest == CPU_PROCESS_METRIC and isinstance(value, (int, float)) and value > 0:
                last[node] = i
    return last


def _node_sums(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """node -> {"thread/<role>", "process", "span/<span>", "sampled/<role>/<category>": seconds,
    "rows": how many rows the sums cover}, each node's up to its last CPU read (_last_sampled)."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    last = _last_sampled(rows)
    for node, i in last.items():
        out[node]["rows"] = i + 1
    for i, row in enumerate(rows):
        for key, value in row.items():
            if not isinstance(value, (int, float)) or "/" not in key:
                continue
            node, _, rest = key.partition("/")
            if i > last.get(node, len(rows)):
                continue
            name, _, labels = rest.partition("/")
            if name == CPU_THREAD_METRIC:
                out[node][f"thread/{labels}"] += value
            elif name == CPU_PROCESS_METRIC and not labels:
                out[node]["process"] += value
            elif name == SPAN_CPU_METRIC:
                out[node][f"span/{labels}"] += value
            elif name == CPU_SAMPLED_METRIC:
                category, _, role = labels.partition("/")
                out[node][f"sampled/{role}/{category}"] += value
    return out


def split_role(seconds: float, role: str, sampled: dict[str, float]) -> dict[str, float]:
    """A thread role's framework CPU by category: in the proportions the sampler saw (UNSEEN
    spread over the rest), else the role's own category."""
    seen = {c: v for c, v in sampled.items() if c != UNSEEN and v > 0}
    total = sum(seen.values())
    if seconds <= 0:
        return {}
    if total <= 0:
        return {ROLE_CATEGORY.get(role, "other"): seconds}
    return {c: seconds * v / total for c, v in seen.items()}


def process_breakdown(sums: dict[str, float]) -> dict[str, Any]:
    """Seconds of one node (all its replicas) over the rows summed: compute, framework, by
    category and by thread role, sampled or not."""
    threads = {k.split("/", 1)[1]: v for k, v in sums.items() if k.startswith("thread/")}
    # the compute thread's CPU inside calls is at most all of its CPU: spans ride on tickets and the
    # threads are read on a timer, so the rows summed can hold a call's span whose thread CPU a row
    # left out holds (the first call's, read in the start-up row: the advantages node once showed
    # 6.3 ms a step against its process's own 4.2)
    in_span = min(sums.get("span/compute", 0.0), threads.get("compute", math.inf))
    sampled: dict[str, dict[str, float]] = defaultdict(dict)
    for k, v in sums.items():
        if k.startswith("sampled/"):
            _, role, category = k.split("/", 2)
            sampled[role][category] = v
    by_role = {role: v for role, v in threads.items() if role not in ("torch",)}
    by_role["compute"] = max(0.0, threads.get("compute", 0.0) - in_span)  # outside compute spans
    ended = max(0.0, sums.get("process", 0.0) - sum(threads.values()))
    if ended > 0:
        by_role["ended"] = ended
    categories: dict[str, float] = defaultdict(float)
    for role, seconds in by_role.items():
        for c, v in split_role(seconds, role, sampled.get(role, {})).items():
            categories[c] += v
    compute = in_span + threads.get("torch", 0.0)
    framework = sum(by_role.values())
    return {"compute_s": compute, "framework_s": framework, "cpu_s": compute + framework,
            "process_cpu_s": sums.get("process", 0.0),
            "categories_s": {c: categories.get(c, 0.0) for c in CATEGORIES},
            "threads_s": {"compute_in_span": in_span, "torch": threads.get("torch", 0.0),
                          **{("compute_outside" if r == "compute" else r): v for r, v in by_role.items()}},
            "sampled": bool(sampled), "sampled_s": {r: dict(c) for r, c in sampled.items()}}


def cpu_breakdown(rows: list[dict[str, Any]], uses: dict | None = None) -> dict[str, Any] | None:
    """The CPU-per-step table's numbers (ms per step, and shares), or None when the run has no
    CPU accounting (a run from before it existed)."""
    body = rows[1:] if len(rows) > 1 else rows
    sums = _node_sums(body)
    sums = {n: s for n, s in sums.items() if any(k.startswith("thread/") for k in s)}
    if not sums or not body:
        return None
    steps = len(body)
    wall = sum(r.get("step_time_s") or 0.0 for r in body)
    nodes: dict[str, Any] = {}
    total = {"compute_s": 0.0, "framework_s": 0.0, "cpu_s": 0.0, "categories_s": defaultdict(float)}
    for node, s in sums.items():
        b = process_breakdown(s)
        use = (uses or {}).get(node)
        replicas = use.replicas if use is not None else 1
        covered = int(s.get("rows") or steps)  # rows up to the node's last CPU read
        node_wall = sum(r.get("step_time_s") or 0.0 for r in body[:covered]) * replicas
        cpu = b["cpu_s"]
        per = 1e3 / covered
        entry = {
            "replicas": replicas, "sampled": b["sampled"], "steps": covered,
            "wall_ms": node_wall * per, "cpu_ms": cpu * per,
            "compute_ms": b["compute_s"] * per, "framework_ms": b["framework_s"] * per,
            "categories_ms": {c: v * per for c, v in b["categories_s"].items()},
            "threads_ms": {r: v * per for r, v in b["threads_s"].items()},
            "idle_ms": max(0.0, node_wall - cpu) * per,
            "wait_input_ms": (use.ratio("wait_input") * node_wall * per) if use is not None else None,
            "compute_pct": 100 * b["compute_s"] / cpu if cpu > 0 else 0.0,
            "framework_pct": 100 * b["framework_s"] / cpu if cpu > 0 else 0.0,
            "process_cpu_ms": b["process_cpu_s"] * per,
            # what the sampler attributed, before scaling (UNSEEN: found at rest); the seen part
            # against the thread's CPU says how many looks the split rests on
            "sampled_ms": {r: {c: v * per for c, v in cs.items()} for r, cs in b["sampled_s"].items()},
        }
        nodes[node] = entry
        for k in ("compute_s", "framework_s", "cpu_s"):  # per step: the nodes' windows may differ
            total[k] += b[k] / covered
        for c, v in b["categories_s"].items():
            total["categories_s"][c] += v / covered
    per = 1e3
    cpu = total["cpu_s"]
    return {
        "steps": steps, "first_step": body[0].get("step"), "last_step": body[-1].get("step"),
        "step_wall_ms": wall * per / steps, "nodes": nodes,
        "total": {"cpu_ms": cpu * per, "compute_ms": total["compute_s"] * per,
                  "framework_ms": total["framework_s"] * per,
                  "categories_ms": {c: v * per for c, v in total["categories_s"].items()},
                  "framework_pct": 100 * total["framework_s"] / cpu if cpu > 0 else 0.0},
        "sampled": any(n["sampled"] for n in nodes.values()),
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}")


def breakdown_table(b: dict[str, Any], order: list[str] | None = None) -> list[str]:
    """The "CPU per step" section of summary.txt."""
    rank = {n: i for i, n in enumerate([*(order or []), "controller"])}
    names = sorted(b["nodes"], key=lambda n: (rank.get(n, len(rank)), n))
    cats = [c for c in CATEGORIES if b["total"]["categories_ms"].get(c, 0.0) >= 0.05]
    head = (f"{'process':<12}{'wall':>7}{'cpu':>7}{'compute':>14}{'framework':>14}"
            + "".join(f"{c[:11]:>12}" for c in cats) + f"{'idle':>8}{'wait_input':>11}")
    lines = [f"CPU per step, steps {b['first_step']}..{b['last_step']} (ms per step; compute and "
             f"framework also as % of the process's CPU):", head]
    for n in names:
        e = b["nodes"][n]
        lines.append(f"{n:<12}{_ms(e['wall_ms']):>7}{_ms(e['cpu_ms']):>7}"
                     f"{_ms(e['compute_ms']) + ' ' + format(e['compute_pct'], '3.0f') + '%':>14}"
                     f"{_ms(e['framework_ms']) + ' ' + format(e['framework_pct'], '3.0f') + '%':>14}"
                     + "".join(f"{_ms(e['categories_ms'].get(c)):>12}" for c in cats)
                     + f"{_ms(e['idle_ms']):>8}{_ms(e['wait_input_ms']):>11}")
    t = b["total"]
    lines.append(f"{'total':<12}{_ms(b['step_wall_ms']):>7}{_ms(t['cpu_ms']):>7}"
                 f"{_ms(t['compute_ms']) + ' ' + format(100 - t['framework_pct'], '3.0f') + '%':>14}"
                 f"{_ms(t['framework_ms']) + ' ' + format(t['framework_pct'], '3.0f') + '%':>14}"
                 + "".join(f"{_ms(t['categories_ms'].get(c)):>12}" for c in cats))
    lines.append(f"framework share of all CPU: {t['framework_pct']:.1f}% "
                 f"({_ms(t['framework_ms'])} of {_ms(t['cpu_ms'])} ms per step)")
    if not b["sampled"]:
        lines.append("framework by thread only: nothing was sampled (FLOWRL_CPU_SAMPLER=0, or no "
                     "loop profiler on this platform), so the event loop's CPU is all control")
    return lines
