"""The node-side recorder: cheap calls, small msgpack-able deltas, process and device samples."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import msgpack
import pytest

from flowrl.metrics import Recorder
from flowrl.metrics.process import ProcessSampler
from flowrl.metrics.wire import parse_snapshot


def _metrics(snap):
    return {(m[0], m[1], tuple(sorted(m[2].items()))): m[4] for m in snap["metrics"]}


def test_drain_returns_a_small_msgpack_able_snapshot_and_resets_windows():
    rec = Recorder(node="rollout", replica=1)
    rec.count("samples", 64)
    rec.count("samples", 64)
    rec.mean("reward", 0.5, weight=4)
    rec.max("staleness", 1)
    rec.observe("rollout_latency_s", 0.12)
    rec.gauge("policy_version", 3)
    rec.count("channel_bytes", 1000, edge="rollout->reward")
    snap = rec.drain()
    packed = msgpack.packb(snap)
    assert msgpack.unpackb(packed) == snap  # only str/int/float/bool/list/dict inside
    assert len(packed) < 1500
    assert snap["node"] == "rollout" and snap["replica"] == 1
    m = _metrics(snap)
    assert m[("samples", "sum", ())] == [128]
    assert m[("reward", "mean", ())] == [2.0, 4]
    assert m[("staleness", "max", ())] == [1]
    assert m[("channel_bytes", "sum", (("edge", "rollout->reward"),))] == [1000]
    parse_snapshot(snap)  # the controller accepts what the recorder sends
    again = _metrics(rec.drain())
    assert ("samples", "sum", ()) not in again  # windows restart empty: no double counting


def test_gauges_are_sent_only_when_they_change():
    rec = Recorder("actor")
    rec.gauge("policy_version", 3, across="max")
    assert ("policy_version", "gauge", ()) in _metrics(rec.drain())
    assert ("policy_version", "gauge", ()) not in _metrics(rec.drain())
    rec.gauge("policy_version", 4, across="max")
    assert _metrics(rec.drain())[("policy_version", "gauge", ())][0] == 4


def test_span_time_is_counted_per_node_including_spans_still_open_at_drain():
    rec = Recorder("actor")
    rec.add_span("compute", 100.0, 0.5, batch_id="t1")
    inside, release = threading.Event(), threading.Event()

    def worker():
        with rec.span("wait_input"):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=worker, name="trainer")
    t.start()
    try:
        assert inside.wait(10)
        assert rec.state() == "wait_input"
        snap = rec.drain()  # wait_input is still open: its time so far is already counted
        spans_s = {m[2]["span"]: m[4][0] for m in snap["metrics"] if m[0] == "span_s"}
        assert spans_s["compute"] == pytest.approx(0.5)
        assert spans_s["wait_input"] >= 0
        assert snap["state"] == "wait_input"
        assert [s[1] for s in snap["spans"]] == ["compute"]  # the open span is not in the trace yet
    finally:
        release.set()
        t.join(10)
    snap = rec.drain()
    (span,) = snap["spans"]
    assert span[1] == "wait_input" and span[3] >= 0
    assert snap["threads"][str(span[0])] == "trainer"
    assert snap["state"] == "idle"


def test_state_is_the_work_a_process_does_while_another_task_waits_for_input():
    rec = Recorder("actor")
    with rec.span("wait_input"):  # the input task waits for the next batch ...
        with rec.span("compute"):  # ... while the main task computes the current one
            assert rec.state() == "compute"
            with rec.span("wait_credit"):
                assert rec.state() == "compute"
        with rec.span("wait_credit"):
            assert rec.state() == "wait_credit"
        assert rec.state() == "wait_input"


def test_each_snapshot_says_which_seconds_it_covers():
    t = [1000.0]
    rec = Recorder("actor", clock=lambda: t[0])
    t[0] = 1002.5
    first = rec.drain()
    t[0] = 1003.0
    second = rec.drain()
    assert (first["since"], first["t"]) == (1000.0, 1002.5)
    assert (second["since"], second["t"]) == (1002.5, 1003.0)
    assert parse_snapshot(second).since == 1002.5


def test_spans_beyond_the_buffer_limit_are_dropped_and_counted():
    rec = Recorder("rollout", max_spans=3)
    for i in range(5):
        rec.add_span("compute", 1.0 + i, 0.1)
    snap = rec.drain()
    assert len(snap["spans"]) == 3 and snap["dropped_spans"] == 2


def test_recorder_rejects_bad_names_and_reserved_labels():
    rec = Recorder("rollout")
    with pytest.raises(ValueError, match="metric name"):
        rec.count("bad name")
    with pytest.raises(ValueError, match="set by the recorder"):
        rec.count("samples", 1, node="x")
    with pytest.raises(ValueError, match="negative duration"):
        rec.add_span("compute", 1.0, -0.1)


def test_a_call_seen_before_keeps_its_series_and_bad_names_and_labels_stay_refused():
    """The recorder remembers each call's series key; what it refused it refuses every time, and
    label values that compare equal but print differently (1 and 1.0) stay different labels."""
    rec = Recorder("rollout")
    for _ in range(2):
        rec.count("tokens", 3, edge="a->b")
        rec.count("retries", 1, attempt=1)
        rec.count("retries", 1, attempt=1.0)
        with pytest.raises(ValueError, match="metric name"):
            rec.count("bad name", 1, edge="a->b")
        with pytest.raises(ValueError, match="set by the recorder"):
            rec.count("samples", 1, node="x")
        with pytest.raises(ValueError, match="not allowed"):
            rec.count("samples", 1, **{"bad-label": "x"})
    metrics = {(m[0], tuple(sorted(m[2].items()))): m[4] for m in rec.drain()["metrics"] if m[0] != "span_s"}
    assert metrics == {("tokens", (("edge", "a->b"),)): [6], ("retries", (("attempt", "1"),)): [2],
                       ("retries", (("attempt", "1.0"),)): [2]}


def test_importing_flowrl_metrics_loads_no_torch_matplotlib_or_rich():
    code = ("import sys, flowrl.metrics; from flowrl.metrics import Recorder, MetricsHub, LiveView; "
            "Recorder('x').drain(); "
            "print(sorted(m for m in ('torch', 'matplotlib', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_sample_process_records_cpu_and_resident_memory_as_per_node_gauges():
    rec = Recorder("reward")
    got = rec.sample_process()
    assert got["rss_bytes"] > 10 * 2**20 and got["cpu_percent"] >= 0
    m = {(x[0], x[3]) for x in rec.drain()["metrics"]}
    assert ("rss_bytes", True) in m and ("cpu_percent", True) in m


class FakeNvml:
    """Two visible devices (physical 3 and 5); our process uses 1 GiB on device 3."""

    def __init__(self, pid):
        self.pid = pid

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu={3: 88, 5: 12}[h])

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=40 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=self.pid, usedGpuMemory=2**30 if h == 3 else None),
                SimpleNamespace(pid=1, usedGpuMemory=5 * 2**30)]


class FakeCuda:
    def is_initialized(self):
        return True

    def device_count(self):
        return 2

    def memory_allocated(self, i):
        return 6 * 2**30

    def memory_reserved(self, i):
        return 10 * 2**30

    def max_memory_allocated(self, i):
        return 8 * 2**30


def test_gpu_sampling_reads_nvml_and_the_allocator_for_the_visible_physical_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    sampler = ProcessSampler(nvml=FakeNvml(os.getpid()), torch_module=SimpleNamespace(cuda=FakeCuda()))
    got = {(name, labels.get("device")): v for name, v, labels in sampler.sample()}
    assert got[("gpu_utilization_percent", "3")] == 88
    assert got[("gpu_utilization_percent", "5")] == 12
    assert got[("gpu_process_memory_bytes", "3")] == 2**30  # only this pid's share
    assert got[("gpu_process_memory_bytes", "5")] == 0
    assert got[("memory_fragmentation", "5")] == pytest.approx(0.4)  # 1 - 6/10
    assert got[("cuda_memory_reserved_bytes", "3")] == 10 * 2**30


def test_a_failing_nvml_turns_gpu_sampling_off_instead_of_crashing_the_node(monkeypatch):
    class Broken(FakeNvml):
        def nvmlDeviceGetUtilizationRates(self, h):
            raise RuntimeError("GPU is lost")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    sampler = ProcessSampler(nvml=Broken(0))
    names = {name for name, _, _ in sampler.sample()}
    assert "cpu_percent" in names and "gpu_utilization_percent" not in names
    assert not any(n.startswith("gpu") for n, _, _ in sampler.sample())


@pytest.mark.gpu
def test_sample_process_on_a_real_gpu_reports_utilisation_memory_and_fragmentation():
    if not os.path.exists("/dev/nvidiactl"):  # decide before paying for `import torch`
        pytest.skip("no NVIDIA driver")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del x
    got = Recorder("actor").sample_process()
    assert any(k.startswith("gpu_utilization_percent/") for k in got)
    assert any(k.startswith("memory_fragmentation/") for k in got)
