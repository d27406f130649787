"""The controller-side hub: replicas reduced correctly, one JSONL row per step."""

from __future__ import annotations

import json

import msgpack
import pytest

from flowrl.metrics import MetricsHub, Recorder, SnapshotError
from flowrl.metrics.rows import LEADING, REQUIRED


def _ship(hub, rec):
    hub.ingest(msgpack.unpackb(msgpack.packb(rec.drain())))  # as the runtime does, over the wire


def test_hub_reduces_replicas_sum_mean_max_and_histograms_on_known_numbers(tmp_path, clock):
    hub = MetricsHub(tmp_path, clock=clock)
    r0, r1 = Recorder("rollout", 0, clock=clock), Recorder("rollout", 1, clock=clock)
    r0.count("samples", 64), r1.count("samples", 32)
    r0.mean("reward", 1.0, weight=3), r1.mean("reward", 5.0, weight=1)
    r0.max("staleness", 1), r1.max("staleness", 2)
    for v in (0.1, 0.2, 0.3, 0.4):
        r0.observe("rollout_latency_s", v, buckets=[0.1, 0.2, 0.3, 0.4, 0.5])
    for v in (0.5, 0.5, 0.5, 0.5):
        r1.observe("rollout_latency_s", v, buckets=[0.1, 0.2, 0.3, 0.4, 0.5])
    _ship(hub, r0), _ship(hub, r1)
    clock.t += 2.0
    row = hub.end_step(step=1, policy_version=1)
    hub.close()
    assert row["samples"] == 96
    assert row["reward_mean"] == pytest.approx(2.0)  # (3*1 + 1*5) / 4
    assert row["staleness_max"] == 2
    assert row["rollout_latency_s_count"] == 8
    assert row["rollout_latency_s_max"] == 0.5
    assert row["rollout_latency_s_mean"] == pytest.approx(0.375)
    assert row["rollout_latency_s_p50"] == pytest.approx(0.4)


def test_each_end_step_appends_one_jsonl_row_with_the_contract_keys(tmp_path, clock):
    with MetricsHub(tmp_path, clock=clock) as hub:
        rec = Recorder("actor", clock=clock)
        for step in (1, 2, 3):
            rec.count("samples", 8)
            rec.mean("policy_loss", 0.5 / step)
            if step != 2:
                rec.mean("reward", 0.1 * step)
            _ship(hub, rec)
            clock.t += 1.0
            hub.end_step(step=step, policy_version=step, extra={"lr": 1e-5})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert list(r)[: len(REQUIRED)] == list(REQUIRED)
        assert r["lr"] == 1e-5 and r["samples"] == 8
    assert rows[1]["reward_mean"] is None  # known series, silent this step: null, column kept
    assert rows[2]["wall_s"] == pytest.approx(3.0)
    assert rows[2]["policy_loss_mean"] == pytest.approx(0.5 / 3)


def test_throughput_is_tokens_over_step_time_times_devices(tmp_path, clock):
    with MetricsHub(tmp_path, devices=4, clock=clock) as hub:
        rec = Recorder("rollout", clock=clock)
        rec.count("tokens", 8000)  # prompt + response tokens
        _ship(hub, rec)
        clock.t += 2.0
        row = hub.end_step(step=1)
    assert row["step_time_s"] == pytest.approx(2.0)
    assert row["tokens_per_s"] == pytest.approx(4000)
    assert row["tokens_per_s_per_device"] == pytest.approx(1000)  # verl: / (time x devices)
    assert row["devices"] == 4


def test_per_node_metrics_and_controller_labels_become_node_prefixed_keys(tmp_path, clock):
    with MetricsHub(tmp_path, clock=clock) as hub:
        recs = []
        for replica, rss in ((0, 100.0), (1, 300.0)):
            rec = Recorder("rollout", replica, clock=clock)
            rec.gauge("rss_bytes", rss, per_node=True)
            rec.add_span("compute", clock.t, 1.5)
            recs.append(rec)
        hub.set("queue_depth", 3, edge="rollout->reward")
        hub.set("node_up", 0, node="critic")
        hub.inc("restarts", node="critic")
        hub.inc("restarts", node="critic")
        clock.t += 2.0
        for rec in recs:  # each snapshot covers the 2 s since the recorder started
            _ship(hub, rec)
        row = hub.end_step(step=1)
        state = hub.live_state()
    assert row["rollout/rss_bytes"] == 200.0  # gauges average over replicas by default
    assert row["rollout/compute_ratio"] == pytest.approx(0.75)  # 2 x 1.5 s / (2 replicas x 2 s)
    assert row["rollout/busy_ratio"] == pytest.approx(0.75)
    assert row["rollout/idle_ratio"] == pytest.approx(0.25)
    assert row["queue_depth/rollout->reward"] == 3
    assert row["critic/node_up"] == 0 and row["critic/restarts"] == 2
    nodes = {n["node"]: n for n in state["nodes"]}
    assert nodes["critic"]["up"] is False and nodes["critic"]["restarts"] == 2
    assert nodes["rollout"]["replicas"] == 2 and nodes["rollout"]["busy_ratio"] == pytest.approx(0.75)
    assert state["edges"] == [{"edge": "rollout->reward", "queue_depth": 3}]
    json.dumps(state, allow_nan=False)


def test_a_malformed_snapshot_is_rejected_counted_and_changes_nothing(tmp_path, clock):
    with MetricsHub(tmp_path, clock=clock) as hub:
        good = Recorder("rollout", clock=clock)
        good.count("samples", 5)
        snap = good.drain()
        bad = dict(snap, metrics=[["samples", "sum", {}, False, ["five"]]])
        unhashable = [dict(snap, metrics=[[["samples"], "sum", {}, False, [1]]]),   # names that are no str
                      dict(snap, metrics=[["samples", "sum", {("a",): "b"}, False, [1]]]),
                      dict(snap, spans=[[1, {"compute": 1}, 0, 5, {}]])]
        for broken in (bad, {"v": 99}, "not a map", dict(snap, spans=[[1, "compute", 0, -5, {}]]), *unhashable):
            with pytest.raises(SnapshotError):
                hub.ingest(broken)
        other = Recorder("rollout", clock=clock)
        other.observe("staleness", 1, buckets=[1, 2])
        hub.ingest(other.drain())
        other.observe("staleness", 1, buckets=[1, 2, 3])
        with pytest.raises(SnapshotError, match="different buckets"):
            hub.ingest(other.drain())
        hub.ingest(snap)
        assert hub.rejected == 8
        assert hub.end_step(step=1)["samples"] == 5


def test_resume_appends_rows_continues_wall_time_and_keeps_the_previous_trace(tmp_path, clock):
    with MetricsHub(tmp_path, clock=clock) as hub:
        clock.t += 10.0
        hub.end_step(step=1)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "wal')  # the crash tore the row of step 2 in half
    with MetricsHub(tmp_path, clock=clock) as hub:
        clock.t += 5.0
        hub.end_step(step=2)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    rows = [json.loads(line) for line in (lines[0], lines[2])]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["wall_s"] == pytest.approx(15.0)
    assert (tmp_path / "trace.1.json").exists() and (tmp_path / "trace.json").exists()


def test_non_finite_values_are_written_as_null_so_the_row_stays_valid_json(tmp_path, clock):
    with MetricsHub(tmp_path, clock=clock) as hub:
        rec = Recorder("actor", clock=clock)
        rec.mean("policy_loss", float("nan"))
        _ship(hub, rec)
        clock.t += 1
        hub.end_step(step=1, extra={"grad_norm": float("inf")})
    line = (tmp_path / "metrics.jsonl").read_text()
    row = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in JSONL"))
    assert row["policy_loss_mean"] is None and row["grad_norm"] is None


def test_busy_ratios_cover_trailing_seconds_not_the_last_short_step(tmp_path, clock):
    """Snapshots every 0.5 s, steps every 0.2 s: a per-step window would see the critic's work
    in one step and 0% in the next two. The trailing window shows what it really does."""
    with MetricsHub(tmp_path, clock=clock, ratio_window_s=5.0) as hub:
        critic = Recorder("critic", clock=clock)
        busy = []
        for step in range(1, 51):  # 10 s: 0.2 s steps, the critic computes 0.12 s of each
            critic.add_span("compute", clock.t, 0.12)
            critic.add_span("wait_input", clock.t + 0.12, 0.08)
            clock.t += 0.2
            if step % 5 == 0 or step % 5 == 3:  # a drain about every 0.5 s
                _ship(hub, critic)
            busy.append(hub.end_step(step=step).get("critic/busy_ratio"))
        live = hub.node_ratios()[("critic", 0)]
    assert all(b == pytest.approx(0.6, abs=0.1) for b in busy[10:]), busy
    assert live["compute"] == pytest.approx(0.6, abs=0.05)
    assert live["wait_input"] == pytest.approx(0.4, abs=0.05)


def test_an_input_task_waiting_while_the_main_task_computes_is_not_counted_twice(tmp_path, clock):
    with MetricsHub(tmp_path, clock=clock) as hub:
        rec = Recorder("actor", clock=clock)
        rec.add_span("wait_input", clock.t, 2.0)  # the input task waits the whole time ...
        rec.add_span("compute", clock.t + 0.5, 1.5)  # ... while the main task computes 75%
        clock.t += 2.0
        _ship(hub, rec)
        row = hub.end_step(step=1)
    assert row["actor/compute_ratio"] == pytest.approx(0.75)
    assert row["actor/wait_input_ratio"] == pytest.approx(0.25)
    assert row["actor/busy_ratio"] + row["actor/wait_input_ratio"] == pytest.approx(1.0)


def test_rows_follow_series_that_come_and_go_between_steps(tmp_path, clock):
    """Rows reuse their grouping and key order from step to step; a series that appears later, a
    replica that joins and one that `forget` removes change the row's keys at the next step."""
    hub = MetricsHub(tmp_path, clock=clock)
    r0 = Recorder("rollout", 0, clock=clock)
    r0.count("samples", 8)
    _ship(hub, r0)
    clock.t += 1.0
    first = hub.end_step(step=1)
    assert first["samples"] == 8 and "loss_mean" not in first
    r0.count("samples", 8)
    r0.mean("loss", 2.0)  # a new series
    r0.count("restarts_seen", 1, per_node=True)
    r1 = Recorder("rollout", 1, clock=clock)  # a replica that joined
    r1.count("samples", 4)
    _ship(hub, r0), _ship(hub, r1)
    clock.t += 1.0
    second = hub.end_step(step=2)
    assert second["samples"] == 12 and second["loss_mean"] == 2.0 and second["rollout/restarts_seen"] == 1
    assert list(second)[:len(REQUIRED)] == list(REQUIRED)
    rest = list(second)[len(LEADING):]
    assert rest == sorted(rest) and "loss_mean" in rest  # the new keys take their sorted places
    hub.forget("rollout", 0)  # removed by `flowrl scale`: its series go, and their keys with them
    r1.count("samples", 4)
    _ship(hub, r1)
    clock.t += 1.0
    third = hub.end_step(step=3)
    hub.close()
    assert third["samples"] == 4 and "rollout/restarts_seen" not in third and "loss_mean" not in third
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["loss_mean"] == 2.0
