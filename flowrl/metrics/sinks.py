"""Metric sinks beside metrics.jsonl: each gets every finished row (one per training step).

    metrics: {tensorboard: true, wandb: true}        # in a graph file
    flowrl run graphs/grpo-math.yaml metrics.tensorboard=true

A sink is a class with `write(row)` and `close()`, one module per backend (tensorboard.py,
wandb.py), built by :func:`build_sinks` from the graph's `metrics:` section. A failing sink is
logged and switched off; it never stops the run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from flowrl.metrics.sink import MetricSink, numeric

__all__ = ["MetricSink", "build_sinks", "numeric", "sinks_for_run"]

log = logging.getLogger(__name__)


def build_sinks(spec: Any, run_dir: str | Path, graph_name: str = "flowrl") -> list[MetricSink]:
    """The sinks a graph's `metrics:` section (a MetricsSpec or a mapping) asks for."""
    from flowrl.graph.spec import MetricsSpec

    spec = spec if isinstance(spec, MetricsSpec) else MetricsSpec.model_validate(spec or {})
    sinks: list[MetricSink] = []
    if spec.tensorboard:
        from flowrl.metrics.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(Path(run_dir) / "tensorboard"))
    if spec.wandb:
        from flowrl.metrics.wandb import WandbSink

        sinks.append(WandbSink(run_dir, project=spec.wandb_project, mode=spec.wandb_mode, name=graph_name))
    return sinks


def sinks_for_run(run_dir: str | Path) -> list[MetricSink]:
    """Sinks named by the `metrics:` section of RUN_DIR/graph.yaml (the resolved graph `flowrl run`
    writes before it starts the hub); none when there is no such file or section."""
    import yaml

    path = Path(run_dir) / "graph.yaml"
    if not path.exists():
        return []
    data = yaml.safe_load(path.read_text()) or {}
    section = data.get("metrics") if isinstance(data, dict) else None
    if not section:
        return []
    return build_sinks(section, run_dir, str(data.get("name", "flowrl")))
