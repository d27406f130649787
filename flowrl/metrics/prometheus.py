"""Prometheus endpoint for `flowrl run --metrics-port PORT`: every hub series, scraped live.

    server = serve_prometheus(hub, port=9400)        # loopback unless host= says otherwise
    # curl http://127.0.0.1:9400/metrics
    server.close()

Mapping (names `flowrl_<name>`, a trailing `_s` becomes `_seconds`; labels node, replica and the
metric's own, e.g. edge, device, span):

    sum        -> counter    flowrl_samples_total, flowrl_channel_bytes_total{edge}
    mean       -> summary    flowrl_reward_sum / flowrl_reward_count (exact weighted means in
                             PromQL: rate(_sum) / rate(_count)) + gauge flowrl_reward_mean (last step)
    max, min   -> gauge      flowrl_staleness_max (last step)
    gauge      -> gauge      flowrl_cpu_percent, flowrl_node_up{node}
    histogram  -> histogram  flowrl_rollout_latency_seconds_bucket{le}, flowrl_staleness_bucket
    derived    -> gauge      flowrl_tokens_per_second_per_device (verl), flowrl_node_busy_ratio, ...

A collector reads the hub at scrape time (no second copy of the numbers to keep in sync), on the
HTTP server's own thread; the hub's lock makes that safe.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any

from flowrl.metrics.rows import busy_of

if TYPE_CHECKING:
    from flowrl.metrics.hub import MetricsHub

log = logging.getLogger(__name__)

HELP = {
    "cpu_percent": "CPU use of the node process (100 = one core)",
    "rss_bytes": "resident memory of the node process",
    "gpu_utilization_percent": "NVML utilisation of a device the node process uses",
    "gpu_memory_used_bytes": "NVML memory used on the device (all processes)",
    "gpu_process_memory_bytes": "NVML memory used on the device by this node process",
    "memory_fragmentation": "1 - allocated/reserved of the torch CUDA caching allocator (>0.3 is bad)",
    "rollout_latency_s": "seconds from ticket to generated batch in a rollout replica",
    "channel_bytes": "bytes sent on a graph edge (counted by the sender)",
    "channel_messages": "messages sent on a graph edge (counted by the sender)",
    "queue_depth": "batches waiting on a graph edge",
    "channel_rejected": "messages a consumer rejected on a graph edge (malformed, over a limit, against the protocol)",
    "channel_shm_bytes": "tensor bytes that crossed a graph edge through shared memory instead of the socket",
    "weight_sync_bytes": "bytes broadcast by weight sync",
    "weight_sync_s": "seconds per weight sync",
    "node_up": "1 while the node's processes are healthy, else 0",
    "restarts": "node process restarts by the supervisor",
    "staleness": "policy versions between generation and the update that used the sample",
    "reward": "reward per sample",
    "tokens": "prompt + response tokens",
    "samples": "samples (trajectories)",
    "span_s": "seconds each node process spent in a trace span (compute, wait_input, ...)",
}


def prom_base(name: str) -> str:
    base = re.sub(r"[^a-zA-Z0-9_]", "_", name)
    if base.endswith("_s"):
        base = base[:-2] + "_seconds"
    return "flowrl_" + base


class HubCollector:
    """A prometheus_client collector that renders the hub's current series."""

    def __init__(self, hub: MetricsHub):
        self.hub = hub

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import Metric

        fams: dict[str, Any] = {}

        def fam(name: str, typ: str, doc: str) -> Any:
            f = fams.get(name)
            if f is None or f.type != typ:
                if f is not None:  # same name, other type: keep both, apart
                    name = f"{name}_{typ}"
                f = fams.setdefault(name, Metric(name, doc, typ))
            return f

        hub = self.hub
        up, restarted = [], set()
        for s in hub.series():
            labels = {k: v for k, v in (("node", s.node), ("replica", s.replica)) if v is not None}
            labels = {k: str(v) for k, v in labels.items()} | dict(s.labels)
            if s.name == "node_up":
                up.append(labels)
            elif s.name == "restarts":
                restarted.add(tuple(sorted(labels.items())))
            base = prom_base(s.name)
            doc = HELP.get(s.name, f"flowrl {s.kind} metric {s.name}")
            if s.kind == "sum" and s.total is not None:
                base = base[:-6] if base.endswith("_total") else base
                fam(base, "counter", doc).add_sample(base + "_total", labels, s.total.value)
            elif s.kind == "mean":
                if s.total is not None:
                    f = fam(base, "summary", doc)
                    f.add_sample(base + "_sum", labels, s.total.total)
                    f.add_sample(base + "_count", labels, s.total.weight)
                if s.last.get("_mean") is not None:
                    fam(base + "_mean", "gauge", doc + " (mean over the last step)").add_sample(
                        base + "_mean", labels, s.last["_mean"])
            elif s.kind in ("max", "min"):
                suffix = "_" + s.kind
                if s.last.get(suffix) is not None:
                    fam(base + suffix, "gauge", doc + f" ({s.kind} over the last step)").add_sample(
                        base + suffix, labels, s.last[suffix])
            elif s.kind == "gauge" and s.window is not None and s.window.value is not None:
                fam(base, "gauge", doc).add_sample(base, labels, s.window.value)
            elif s.kind == "hist" and s.total is not None:
                h, f, cum = s.total, fam(base, "histogram", doc), 0
                for bound, c in zip([*h.bounds, float("inf")], h.counts):
                    cum += c
                    le = "+Inf" if bound == float("inf") else repr(float(bound))
                    f.add_sample(base + "_bucket", labels | {"le": le}, cum)
                f.add_sample(base + "_sum", labels, h.total)
                f.add_sample(base + "_count", labels, h.count)
        for labels in up:  # a node that never restarted reads 0, not "no data"
            if tuple(sorted(labels.items())) not in restarted:
                fam("flowrl_restarts", "counter", HELP["restarts"]).add_sample(
                    "flowrl_restarts_total", labels, 0.0)
        yield from fams.values()
        yield from self._derived(Metric)

    def _derived(self, Metric: Any) -> Iterator[Any]:
        hub = self.hub
        with hub._lock:
            derived = dict(hub.derived)
            ratios = hub.node_ratios()
            window = hub.ratio_window_s
            seen = {k: r.seen_t for k, r in hub.reporters.items()}
            rejected, dropped, now = hub.rejected, hub.dropped_spans, hub._clock()
        names = {"step": "step", "wall_s": "wall_seconds", "step_time_s": "step_time_seconds",
                 "policy_version": "run_policy_version", "tokens_per_s": "tokens_per_second",
                 "tokens_per_s_per_device": "tokens_per_second_per_device",
                 "samples_per_s": "samples_per_second", "reward_mean": "run_reward_mean",
                 "staleness_max": "run_staleness_max", "devices": "devices"}
        for key, pname in names.items():
            if key in derived:
                m = Metric("flowrl_" + pname, f"{key} of the last completed step", "gauge")
                m.add_sample("flowrl_" + pname, {}, derived[key])
                yield m
        busy = Metric("flowrl_node_busy_ratio", f"share of the last {window:g} s a node process "
                      f"spent in compute or weight sync", "gauge")
        span = Metric("flowrl_node_span_ratio", f"share of the last {window:g} s in each span "
                      f"(exclusive: work outranks waiting)", "gauge")
        for (node, replica), r in sorted(ratios.items()):
            lab = {"node": node, "replica": str(replica)}
            busy.add_sample(busy.name, lab, busy_of(r))
            for sp, v in sorted(r.items()):
                span.add_sample(span.name, lab | {"span": sp}, v)
        silent = Metric("flowrl_node_silent_seconds", "seconds since the node process's last "
                        "metrics snapshot", "gauge")
        for (node, replica), t in sorted(seen.items()):
            silent.add_sample(silent.name, {"node": node, "replica": str(replica)}, max(0.0, now - t))
        rej = Metric("flowrl_metrics_rejected", "malformed metrics snapshots rejected", "counter")
        rej.add_sample("flowrl_metrics_rejected_total", {}, rejected)
        drop = Metric("flowrl_trace_spans_dropped", "trace spans dropped at a size limit", "counter")
        drop.add_sample("flowrl_trace_spans_dropped_total", {}, dropped)
        yield from (busy, span, silent, rej, drop)


class PrometheusServer:
    """A running /metrics endpoint; `port` is the bound one (useful with port=0)."""

    def __init__(self, httpd: Any, thread: threading.Thread):
        self._httpd, self._thread = httpd, thread
        self.host, self.port = httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self._httpd = None

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_prometheus(hub: MetricsHub, port: int = 0, host: str = "127.0.0.1") -> PrometheusServer:
    """Serve the hub at http://host:port/metrics from a daemon thread. Loopback by default: the
    endpoint has no authentication, so exposing it is a deliberate choice (host="0.0.0.0")."""
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import CollectorRegistry, make_wsgi_app

    class _Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class _Quiet(WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:  # one line per scrape is noise
            pass

    registry = CollectorRegistry(auto_describe=False)
    registry.register(HubCollector(hub))
    try:
        httpd = make_server(host, port, make_wsgi_app(registry), _Server, handler_class=_Quiet)
    except OSError as e:
        raise OSError(f"cannot serve Prometheus metrics on {host}:{port}: {e.strerror or e}; "
                      f"pick another --metrics-port, or 0 for any free port") from e
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                              name="flowrl-prometheus", daemon=True)
    thread.start()
    server = PrometheusServer(httpd, thread)
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("Prometheus metrics are served without authentication on %s", server.url)
    return server
