"""TensorBoard and W&B (offline) sinks: every metrics.jsonl row reaches them, readable by their own tools."""

import pytest

from flowrl.metrics import MetricsHub
from flowrl.metrics.sinks import MetricSink, build_sinks, sinks_for_run


def _rows(hub, n=3):
    for step in range(1, n + 1):
        hub.set("eval", 0.1 * step, metric="reward_greedy")
        hub.inc("samples", 8)
        hub.end_step(step=step, policy_version=step)


def test_the_graph_metrics_section_turns_on_tensorboard_and_its_events_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "graph.yaml").write_text("name: g\nnodes: {a: {kind: prompts}}\nmetrics: {tensorboard: true}\n")
    hub = MetricsHub(tmp_path)  # as `flowrl run` makes it, after writing the resolved graph.yaml
    assert [type(s).__name__ for s in hub.sinks] == ["TensorBoardSink"]
    _rows(hub)
    hub.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"eval/reward_greedy", "samples", "wall_s"} <= set(events.Tags()["scalars"])
    got = [(e.step, round(e.value, 6)) for e in events.Scalars("eval/reward_greedy")]
    assert got == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [e.value for e in events.Scalars("samples")] == [8, 8, 8]


def test_wandb_offline_writes_a_run_folder_and_never_needs_the_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    (sink,) = build_sinks({"wandb": True}, tmp_path, "grpo-math")
    hub = MetricsHub(tmp_path, sinks=[sink])
    _rows(hub)
    hub.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), sorted(p.name for p in (tmp_path / "wandb").iterdir())


def test_no_metrics_section_means_no_sinks_and_a_failing_sink_is_switched_off(tmp_path):
    assert sinks_for_run(tmp_path) == []

    class Broken(MetricSink):
        def write(self, row):
            raise OSError("disk full")

    hub = MetricsHub(tmp_path, sinks=[Broken()])
    _rows(hub, 2)  # the run goes on
    assert hub.sinks == []
    hub.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
