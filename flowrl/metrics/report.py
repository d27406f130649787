"""`flowrl report RUN_DIR`: a finished (or crashed) run as pictures and a short diagnosis.

    make_report("runs/ppo-001")   # -> RUN_DIR/report/{reward,throughput,timeline,staleness,
                                  #    losses}.png, summary.txt and cpu.json (the CPU per step)

Inputs are only metrics.jsonl (with its rotated segments) and trace.json (with the segment before
it, when a long run rotated it; either may be missing or cut short by a crash).
matplotlib is the `report` extra and loads here, on first use, with its Agg canvas (no display,
no global backend switch). Plot and summary wording live in report_plots.py / analysis.py.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from flowrl.metrics.analysis import diagnose, node_utilisation, ordered, utilisation_table
from flowrl.metrics.breakdown import breakdown_table, cpu_breakdown
from flowrl.metrics.steppath import step_path, step_path_table
from flowrl.metrics.trace import load_recent_trace
from flowrl.segments import read_all


class ReportError(ValueError):
    """The run directory has nothing to report on."""


def load_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """metrics.jsonl rows, after those of its compressed segments (`metrics.N.jsonl.gz`: a long run
    rotates its older rows out every 64 MB, ~8,000 steps of graphs/grpo.yaml); a torn last line
    (crash mid-write) is skipped."""
    return [row for row in read_all(Path(path)) if isinstance(row, dict)]


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}{unit}" if abs(x) >= 100 else f"{x:.3g}{unit}"


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if isinstance(r.get(key), (int, float))]


def node_order(run_dir: Path) -> list[str]:
    """The graph's node order (pipeline order as written), from status.json or graph.yaml;
    empty when neither says."""
    try:
        doc = json.loads((run_dir / "status.json").read_text(encoding="utf-8"))
        nodes = (doc.get("graph") or {}).get("nodes") or {}
        if nodes:
            return [str(n) for n in nodes]
    except (OSError, ValueError, AttributeError):
        pass
    try:
        import yaml

        spec = yaml.safe_load((run_dir / "graph.yaml").read_text(encoding="utf-8"))
        return [str(n) for n in (spec.get("nodes") or {})]
    except Exception:  # noqa: BLE001 - no graph file, or not one we can read: first-seen order
        return []


def fused_nodes(run_dir: Path) -> dict[str, list[str]]:
    """host -> the nodes fused into its process (`fuse_into`), from the run's graph.yaml."""
    try:
        import yaml

        spec = yaml.safe_load((run_dir / "graph.yaml").read_text(encoding="utf-8"))
        return {str(h): [str(f) for f in n["fused"]] for h, n in (spec.get("nodes") or {}).items()
                if isinstance(n, dict) and n.get("fused")}
    except Exception:  # noqa: BLE001 - no graph file, or not one we can read: nothing to say
        return {}


def summary_text(run_dir: Path, rows: list[dict[str, Any]], events: list[dict[str, Any]],
                 order: list[str] | None = None) -> str:
    uses = node_utilisation(events)
    bottleneck, advice = diagnose(uses)
    out = [f"flowrl report: {run_dir.name}", ""]
    if rows:
        steps = [r.get("step") for r in rows]
        out.append(f"steps {steps[0]}..{steps[-1]} ({len(rows)} rows), "
                   f"{_fmt(rows[-1].get('wall_s'), ' s')} wall")
        rewards = _series(rows, "reward_mean")
        if rewards:
            k = max(1, min(10, len(rewards) // 4))
            out.append(f"reward_mean: {statistics.fmean(rewards[:k]):.3f} (first {k} steps) -> "
                       f"{statistics.fmean(rewards[-k:]):.3f} (last {k} steps)")
        tps, tpd = _series(rows, "tokens_per_s"), _series(rows, "tokens_per_s_per_device")
        st = _series(rows, "step_time_s")
        if tps:
            total_tokens = sum(_series(rows, "tokens"))
            wall = sum(st) or 1.0
            out.append(f"throughput: {_fmt(total_tokens / wall)} tokens/s overall, "
                       f"median {_fmt(statistics.median(tpd))} tokens/s per device (verl: "
                       f"prompt+response tokens / (step time x devices)); "
                       f"median step time {_fmt(statistics.median(st), ' s')}")
        stale = _series(rows, "staleness_max")
        if stale:
            out.append(f"staleness: max {max(stale):g}, mean of per-step max "
                       f"{statistics.fmean(stale):.2f}")
        restarts = {k.split("/")[0]: sum(_series(rows, k)) for k in rows[-1] if k.endswith("/restarts")}
        if any(restarts.values()):
            out.append("restarts: " + ", ".join(f"{n} {v:g}" for n, v in restarts.items() if v))
    else:
        out.append("metrics.jsonl: no rows (the run ended before its first step)")
    out.append("")
    if uses:
        window = next(iter(uses.values())).window_s
        out.append(f"time per node over the traced {window:.1f} s (replicas averaged):")
        out += ["  " + line for line in utilisation_table(uses, order)]
        out.append("")
        for u in ordered(uses, order):
            out.append(f"idle ratio {u.node}: {100 * u.idle:.0f}%")
        out.append("")
    path = step_path(events)
    if path is not None:  # max_staleness 0: the step is one chain of calls and what joins them
        out += step_path_table(path)
        out.append("")
    cpu = cpu_breakdown(rows, uses)
    if cpu is not None:
        out += breakdown_table(cpu, order)
        out += [f"{host} also runs {', '.join(names)} (fuse_into): their CPU is {host}'s"
                for host, names in fused_nodes(run_dir).items()]
    else:
        out.append("CPU per step: this run has no CPU accounting (metrics.jsonl has no "
                   "cpu_thread_s columns; runs record it since the CPU breakdown was added)")
    out.append("")
    out.append(f"bottleneck: {bottleneck or 'unknown'}")
    out.append(f"suggestion: {advice}")
    return "\n".join(out) + "\n"


def make_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write the plots and summary.txt into RUN_DIR/report/ (or `out_dir`); returns the paths."""
    try:
        import matplotlib  # noqa: F401  (the `report` extra)
    except ImportError as e:
        raise ReportError("flowrl report draws with matplotlib, which is not installed; "
                          "pip install 'flowrl[report]'") from e
    from flowrl.metrics import report_plots

    run_dir = Path(run_dir)
    metrics_path, trace_path = run_dir / "metrics.jsonl", run_dir / "trace.json"
    if not metrics_path.exists() and not trace_path.exists():
        raise ReportError(f"{run_dir} has neither metrics.jsonl nor trace.json; pass the run "
                          f"directory of a `flowrl run` (its --run-dir)")
    rows = load_rows(metrics_path) if metrics_path.exists() else []
    events = load_recent_trace(run_dir)  # a long run's: its newest one or two trace segments
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    order = node_order(run_dir)
    written = report_plots.write_plots(out, rows, events, order)
    breakdown = cpu_breakdown(rows, node_utilisation(events))
    if breakdown is not None:  # a run from before the CPU accounting: summary.txt says so
        cpu = out / "cpu.json"
        cpu.write_text(json.dumps(breakdown, indent=1), encoding="utf-8")
        written.append(cpu)
    summary = out / "summary.txt"
    summary.write_text(summary_text(run_dir, rows, events, order), encoding="utf-8")
    return [*written, summary]


def main(run_dir: str | os.PathLike) -> int:
    """Entry point for the CLI: print the summary and the written paths; exit code 0, or 2 when
    the directory holds no run."""
    try:
        paths = make_report(run_dir)
    except ReportError as e:
        print(f"flowrl report: {e}")
        return 2
    print(paths[-1].read_text(encoding="utf-8"))
    for p in paths:
        print(f"wrote {p}")
    return 0
