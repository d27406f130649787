"""Call a node's hooks directly, in this process: a NodeContext with a real Recorder, and the
metrics row the controller's hub would make of what the node recorded."""

from __future__ import annotations

from pathlib import Path

import anyio

import flowrl
from flowrl.metrics import MetricsHub, Recorder


def make_node(cls, config: dict, *, name: str = "node", seed: int = 0, graph=None, run_dir: Path | None = None):
    ctx = flowrl.NodeContext(name=name, kind=name, replica=0, replicas=1, seed=seed, device="cpu", devices=[0],
                             dtype="float32", run_dir=run_dir, graph=graph, recorder=Recorder(name, 0))
    node = cls(cls.Config.model_validate(config), ctx)
    anyio.run(node.setup)
    return node


def call(fn, *args):
    """Run an async hook (process, generate, observe) to completion."""
    return anyio.run(fn, *args)


def metrics_row(node, tmp_path: Path) -> dict:
    """The metrics.jsonl row of one step holding everything `node` recorded so far."""
    hub = MetricsHub(tmp_path / "hub", sinks=[])
    try:
        hub.ingest(node.ctx.recorder.drain())
        return hub.end_step(step=1)
    finally:
        hub.close()
