"""A real HTTP scrape of the Prometheus endpoint, parsed as Prometheus parses it."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flowrl.metrics import MetricsHub, Recorder, serve_prometheus


def _scrape(url):
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples = {}
    types = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def test_a_real_http_scrape_carries_the_monitoring_list(tmp_path, clock):
    hub = MetricsHub(tmp_path, devices=2, clock=clock)
    rollout = Recorder("rollout", 0, clock=clock)
    actor = Recorder("actor", 0, clock=clock)
    for v in (0.05, 0.2, 0.3, 0.7):
        rollout.observe("rollout_latency_s", v)
    rollout.count("tokens", 4000)
    rollout.count("channel_bytes", 123456, edge="rollout->actor")
    rollout.count("channel_messages", 3, edge="rollout->actor")
    rollout.gauge("cpu_percent", 97.0, per_node=True)
    rollout.gauge("rss_bytes", 2**30, per_node=True)
    rollout.gauge("memory_fragmentation", 0.35, per_node=True, device="0")
    rollout.add_span("compute", clock.t, 1.5)
    actor.mean("reward", 0.5, weight=4)
    actor.mean("policy_loss", 0.25)
    actor.observe("staleness", 0)
    actor.observe("staleness", 1)
    actor.count("weight_sync_bytes", 5_000_000)
    actor.observe("weight_sync_s", 0.3)
    clock.t += 2.0  # the snapshots cover 2 s
    hub.ingest(rollout.drain()), hub.ingest(actor.drain())
    hub.set("node_up", 1, node="rollout")
    hub.set("node_up", 0, node="critic")
    hub.inc("restarts", node="critic")
    hub.set("queue_depth", 2, edge="rollout->actor")
    hub.end_step(step=1, policy_version=1)
    server = serve_prometheus(hub, port=0)
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        types, s = _scrape(server.url)
    finally:
        server.close()
        hub.close()
    ro = (("node", "rollout"), ("replica", "0"))
    ac = (("node", "actor"), ("replica", "0"))
    assert types["flowrl_rollout_latency_seconds"] == "histogram"
    assert s[("flowrl_rollout_latency_seconds_bucket", tuple(sorted(ro + (("le", "0.25"),))))] == 2
    assert s[("flowrl_rollout_latency_seconds_bucket", tuple(sorted(ro + (("le", "+Inf"),))))] == 4
    assert s[("flowrl_rollout_latency_seconds_count", ro)] == 4
    edge = tuple(sorted(ro + (("edge", "rollout->actor"),)))
    assert s[("flowrl_channel_bytes_total", edge)] == 123456
    assert s[("flowrl_channel_messages_total", edge)] == 3
    assert s[("flowrl_cpu_percent", ro)] == 97.0
    assert s[("flowrl_rss_bytes", ro)] == 2**30
    assert s[("flowrl_memory_fragmentation", tuple(sorted(ro + (("device", "0"),))))] == 0.35
    assert s[("flowrl_weight_sync_bytes_total", ac)] == 5_000_000
    assert s[("flowrl_weight_sync_seconds_sum", ac)] == 0.3
    assert s[("flowrl_node_up", (("node", "rollout"),))] == 1
    assert s[("flowrl_node_up", (("node", "critic"),))] == 0
    assert s[("flowrl_restarts_total", (("node", "critic"),))] == 1
    assert s[("flowrl_restarts_total", (("node", "rollout"),))] == 0  # up, never restarted
    assert s[("flowrl_queue_depth", (("edge", "rollout->actor"),))] == 2
    assert types["flowrl_staleness"] == "histogram"
    assert s[("flowrl_staleness_bucket", tuple(sorted(ac + (("le", "0.0"),))))] == 1
    assert s[("flowrl_reward_sum", ac)] == 2.0 and s[("flowrl_reward_count", ac)] == 4
    assert s[("flowrl_reward_mean", ac)] == 0.5
    assert s[("flowrl_policy_loss_mean", ac)] == 0.25
    assert s[("flowrl_tokens_per_second", ())] == 2000
    assert s[("flowrl_tokens_per_second_per_device", ())] == 1000
    assert s[("flowrl_node_busy_ratio", ro)] == 0.75
    assert s[("flowrl_step", ())] == 1


def test_serving_on_a_taken_port_says_which_port_and_what_to_do(tmp_path):
    with socket.socket() as taken, MetricsHub(tmp_path) as hub:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}.*--metrics-port"):
            serve_prometheus(hub, port=port)
