"""trace.json: valid Chrome trace events, one track per node process, readable after a crash."""

from __future__ import annotations

import gzip
import json
import threading
import time

from flowrl.metrics import RUNTIME_SPANS, MetricsHub, Recorder
from flowrl.metrics.trace import TraceWriter, load_recent_trace, load_trace, track_names
from flowrl.segments import next_number, segments


def test_trace_json_is_valid_with_one_named_track_per_node_process(tmp_path):
    hub = MetricsHub(tmp_path)
    recs = [Recorder("rollout", 0), Recorder("rollout", 1), Recorder("actor", 0)]
    for rec in recs:
        for name in RUNTIME_SPANS:
            with rec.span(name, batch_id="t1"):
                pass
    done = threading.Event()

    def sync_thread():  # a second thread of the actor gets its own, named tid
        with recs[2].span("weight_sync", version=1):
            pass
        done.set()

    threading.Thread(target=sync_thread, name="weight-sync").start()
    assert done.wait(10)
    for rec in recs:
        hub.ingest(rec.drain())
    with hub.recorder.span("schedule"):  # the controller's own spans land on its track
        pass
    hub.set("queue_depth", 2, edge="rollout->actor")
    hub.event("restart", node="rollout")
    hub.end_step(step=1)
    hub.close()

    events = json.loads((tmp_path / "trace.json").read_text())  # strict JSON, closed array
    assert events
    for e in events:
        assert {"ph", "ts", "pid", "tid"} <= e.keys(), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    names = track_names(events)
    assert sorted(names.values()) == ["actor/0", "controller", "rollout/0", "rollout/1"]
    assert len(set(names)) == len(names)  # one pid per node process
    spans = [e for e in events if e["ph"] == "X"]
    for pid, name in names.items():
        got = {e["name"] for e in spans if e["pid"] == pid}
        if name != "controller":
            assert got >= set(RUNTIME_SPANS), (name, got)  # every node, every runtime span
    actor = next(p for p, n in names.items() if n == "actor/0")
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
               and e["pid"] == actor}
    assert threads == {"MainThread", "weight-sync"}
    assert any(e["ph"] == "C" and e["name"] == "queue_depth" for e in events)
    assert any(e["ph"] == "i" and e["name"] == "restart" for e in events)
    assert any(e["ph"] == "X" and e["name"] == "schedule" and names[e["pid"]] == "controller"
               for e in events)


def test_a_gauge_goes_into_the_trace_when_its_value_changes_not_at_every_step(tmp_path):
    hub = MetricsHub(tmp_path)
    depths = [2, 2, 2, 5, 5, 2]
    for step, depth in enumerate(depths, 1):
        hub.set("queue_depth", depth, edge="rollout->actor")
        hub.set("node_up", 1, node="actor")
        hub.end_step(step=step)
    hub.close()
    counters = [e for e in load_trace(tmp_path / "trace.json") if e["ph"] == "C"]
    depth = [e["args"]["rollout->actor"] for e in counters if e["name"] == "queue_depth"]
    assert depth == [2, 5, 2]  # a counter holds its value until the next event: nothing is lost
    assert [e["args"] for e in counters if e["name"] == "node_up"] == [{"actor": 1}]
    assert sorted(e["ts"] for e in counters) == [e["ts"] for e in counters]


def test_a_trace_cut_short_by_a_crash_still_loads(tmp_path):
    w = TraceWriter(tmp_path / "trace.json", t0_us=0)
    pid = w.track("rollout", 0, 4242, "h")
    for i in range(3):
        w.complete(pid, 1, "compute", 1000 * i, 500)
    w.flush()  # no close(): the process died; also tear the last line in half
    text = (tmp_path / "trace.json").read_text()
    (tmp_path / "trace.json").write_text(text + ',\n{"ph":"X","na')
    events = load_trace(tmp_path / "trace.json")
    assert sum(e["ph"] == "X" for e in events) == 3
    assert track_names(events)[pid] == "rollout/0"


def test_a_long_trace_goes_on_in_compressed_segments_that_each_stand_alone(tmp_path):
    """Past `segment_events` the file becomes trace.N.json.gz and trace.json starts anew: no event
    is lost, each file names every track and thread and holds the counters' values again, and each
    says which file came before it."""
    w = TraceWriter(tmp_path / "trace.json", t0_us=7, segment_events=10)
    pid = w.track("rollout", 0, 4242, "h")
    w.thread(pid, 1, "flowrl-compute-0")
    for i in range(25):
        w.counter("queue_depth", 1000 * i, {"rollout->reward": 3})  # unchanged: once per file
        w.complete(pid, 1, "compute", 1000 * i, 500)
    w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.1.json.gz", "trace.2.json.gz", "trace.json"]
    assert [p.name for p in segments(tmp_path / "trace.json")] == ["trace.1.json.gz", "trace.2.json.gz"]
    files = [load_trace(tmp_path / name) for name in ("trace.1.json.gz", "trace.2.json.gz", "trace.json")]
    assert [sum(e["ph"] != "M" for e in f) for f in files] == [10, 10, 8]  # the counter's event counts too
    spans = [e["ts"] for f in files for e in f if e["ph"] == "X"]
    assert spans == [max(0, 1000 * i - 7) for i in range(25)]  # microseconds since t0_us
    for k, (events, previous) in enumerate(zip(files, [None, "trace.1.json.gz", "trace.2.json.gz"])):
        assert events[0] == {"ph": "M", "name": "trace_segment", "pid": 1, "tid": 0, "ts": 0,
                             "args": {"t0_us": 7, "segment": k, "previous": previous}}
        assert track_names(events) == {1: "controller", pid: "rollout/0"}
        assert [e["args"]["name"] for e in events if e["name"] == "thread_name"] == ["flowrl-compute-0"]
        assert sum(e["ph"] == "C" for e in events) == 1
    # a report reads the newest file and the one before it: a full segment's events at least
    recent = load_recent_trace(tmp_path)
    assert [e["ts"] for e in recent if e["ph"] == "X"] == spans[9:]  # the second segment's 9 and the last 7


def test_the_recent_trace_is_the_newest_file_alone_when_it_has_no_predecessor_at_hand(tmp_path):
    assert load_recent_trace(tmp_path) == []
    w = TraceWriter(tmp_path / "trace.json", t0_us=0, segment_events=2)
    pid = w.track("actor", 0, 1, "h")
    for i in range(3):
        w.complete(pid, 1, "compute", i, 1)
    w.close()
    assert [e["ts"] for e in load_recent_trace(tmp_path) if e["ph"] == "X"] == [0, 1, 2]
    (tmp_path / "trace.1.json.gz").unlink()  # the predecessor gone (moved away, or never compressed)
    assert [e["ts"] for e in load_recent_trace(tmp_path) if e["ph"] == "X"] == [2]


def test_a_segment_not_compressed_yet_is_read_and_numbered_and_an_earlier_trace_takes_the_next_number(tmp_path):
    w = TraceWriter(tmp_path / "trace.json", t0_us=0, segment_events=1)
    pid = w.track("actor", 0, 1, "h")
    w.complete(pid, 1, "compute", 0, 1)
    w.complete(pid, 1, "compute", 1, 1)
    w.close()
    with gzip.open(tmp_path / "trace.1.json.gz", "rb") as f:  # as a crash before the compression ended leaves it
        (tmp_path / "trace.1.json").write_bytes(f.read())
    (tmp_path / "trace.1.json.gz").unlink()
    assert [e["ts"] for e in load_recent_trace(tmp_path) if e["ph"] == "X"] == [0, 1]
    assert next_number(tmp_path / "trace.json") == 2
    MetricsHub(tmp_path).close()  # a resumed run's controller: the trace it finds moves aside
    assert [p.name for p in segments(tmp_path / "trace.json")] == ["trace.1.json", "trace.2.json"]
    assert [e["ts"] for e in load_trace(tmp_path / "trace.2.json") if e["ph"] == "X"] == [1]


NODE = """
import sys, msgpack
from flowrl.metrics import Recorder
rec = Recorder(sys.argv[1], int(sys.argv[2]))
with rec.span("wait_input"):
    pass
with rec.span("compute", batch_id="t1"):
    pass
sys.stdout.buffer.write(msgpack.packb(rec.drain()))
"""


def test_snapshots_from_separate_node_processes_land_on_their_own_tracks(tmp_path):
    import subprocess
    import sys

    import msgpack

    hub = MetricsHub(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", NODE, node, "0"], stdout=subprocess.PIPE)
             for node in ("rollout", "actor")]
    try:
        for p in procs:
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0
            hub.ingest(msgpack.unpackb(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    hub.close()
    events = json.loads((tmp_path / "trace.json").read_text())
    names = track_names(events)
    by_track = {names[e["pid"]]: [] for e in events if e["ph"] == "X"}
    for e in events:
        if e["ph"] == "X":
            by_track[names[e["pid"]]].append(e)
    assert set(by_track) == {"rollout/0", "actor/0"}
    for spans in by_track.values():
        assert [e["name"] for e in spans] == ["wait_input", "compute"]
        assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)  # on the controller's time axis


def test_spans_of_two_tasks_of_one_thread_that_cross_go_to_a_second_lane(tmp_path):
    """An asyncio input task waits (wait_input) while the main task computes: the spans share a
    thread id but do not nest, which Perfetto would draw wrongly; the second goes to a lane."""
    with MetricsHub(tmp_path) as hub:
        rec = Recorder("actor", 0)
        t = time.time()
        rec.add_span("compute", t, 1.0)
        rec.add_span("wait_input", t + 0.5, 1.0)  # crosses compute: starts inside, ends after
        rec.add_span("wait_credit", t + 0.2, 0.3)  # nested inside compute: stays on the thread
        hub.ingest(rec.drain())
    events = load_trace(tmp_path / "trace.json")
    tids = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
    assert tids["compute"] == tids["wait_credit"] != tids["wait_input"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert lanes[tids["wait_input"]] == "MainThread lane 1"


def test_compact_json_reads_back_as_json_dumps_wrote_it_and_refuses_what_json_refuses():
    import math

    import pytest

    from flowrl.metrics.trace import compact_json

    row = {"step": 3, "wall_s": 1.25, "reward_mean": None, "kl": -8.195638656616211e-08, "tokens": 2**62,
           "channel_bytes/rollout->reward": 12, "name": "caf\u00e9", "ok": True, 7: [1, 2.5, {"a": "b"}]}
    text = compact_json(row)
    assert " " not in text.replace("caf\u00e9", "")  # compact, as separators=(",", ":")
    assert json.loads(text) == json.loads(json.dumps(row, separators=(",", ":")))
    assert json.loads(compact_json({"big": 2**70})) == {"big": 2**70}  # past orjson's 64 bits: json writes it
    assert json.loads(compact_json({"x": math.nan})) == {"x": None}  # valid JSON, where json writes NaN
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError):
        compact_json({"x": np.float32(1.5)})  # as json.dumps: the caller converts its numbers
