"""flowrl observability: metric kinds with their reductions, and the sinks that show them.

    # in each node process
    rec = Recorder(node="rollout", replica=0)
    rec.count("samples", 64); rec.mean("reward", 0.71); rec.observe("rollout_latency_s", 0.12)
    with rec.span("compute", batch_id="t3"): ...
    snap = rec.drain()                    # msgpack-able; the runtime ships it every ~0.5 s

    # in the controller
    hub = MetricsHub(run_dir, devices=3)  # RUN_DIR/metrics.jsonl, RUN_DIR/trace.json
    hub.ingest(snap); row = hub.end_step(step=5, policy_version=5); hub.close()
    server = serve_prometheus(hub, port=9400)          # http://127.0.0.1:9400/metrics
    with LiveView(hub, graph_summary) as view: view.update()
    write_status(run_dir, {**hub.live_state(), "phase": "running"})

    # afterwards: flowrl.metrics.report.make_report(run_dir), flowrl.metrics.status.show_status(run_dir)

Node processes import this package, so nothing here imports torch, matplotlib or rich at import
time (those load on first use); see docs/observability.md for every metric name.
"""

from flowrl.metrics.hub import MetricsHub
from flowrl.metrics.kinds import Gauge, Histogram, Max, Mean, Min, Sum
from flowrl.metrics.live import GraphSummary, LiveView
from flowrl.metrics.prometheus import PrometheusServer, serve_prometheus
from flowrl.metrics.recorder import RUNTIME_SPANS, Recorder
from flowrl.metrics.status import read_status, show_status, write_status
from flowrl.metrics.wire import SnapshotError

__all__ = [
    "Recorder", "MetricsHub", "serve_prometheus", "PrometheusServer", "LiveView", "GraphSummary",
    "write_status", "read_status", "show_status", "SnapshotError", "RUNTIME_SPANS",
    "Sum", "Mean", "Max", "Min", "Gauge", "Histogram",
]
