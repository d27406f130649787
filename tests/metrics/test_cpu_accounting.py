"""Where the cycles go, in pieces: thread roles, per-thread CPU, the stack classifier, the sampler,
the recorder's CPU series and the report's arithmetic (no processes but this one)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from flowrl.metrics import Recorder
from flowrl.metrics.breakdown import breakdown_table, cpu_breakdown, process_breakdown, split_role
from flowrl.metrics.stacks import (UNSEEN, Classifier, StackSampler, classify_code, register_compute_thread,
                                   sampling_from_env)
from flowrl.metrics.threads import ThreadCpu, native_role, python_role, thread_cpu_clock

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_threads_get_a_role_from_their_python_name_or_os_name():
    assert python_role("MainThread") == "loop"
    assert python_role("flowrl-compute-actor.0.0") == "compute"
    assert python_role("flowrl-heartbeat") == "heartbeat"
    assert python_role("flowrl-cpu-sampler") == "sampler"
    assert python_role("AnyIO worker thread") == "pythreads"
    assert native_role("ZMQbg/IO/0", "python") == "zmq"
    assert native_role("pt_gloo_runloop", "python") == "gloo"
    assert native_role("gloo_tcp_loop", "python") == "gloo"
    assert native_role("python", "python") == "torch"  # torch's unnamed intra-op pools
    assert native_role("cuda-EvtHandlr", "python") == "native"


@linux_only
def test_thread_cpu_counts_each_threads_cpu_under_its_role_and_the_process_total():
    acct = ThreadCpu()
    assert acct.read() == ({}, 0.0)  # the first read is the baseline
    t = threading.Thread(target=_spin, args=(0.15,), name="flowrl-compute-test")
    t.start()
    t.join()
    _spin(0.05)
    roles, total = acct.read()
    # the compute thread ended before the read: its time is in the process total, not a thread
    assert roles.get("loop", 0.0) == pytest.approx(0.05, abs=0.03)
    assert total >= 0.15
    spun, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (_spin(0.1), spun.set(), release.wait(5)), name="flowrl-compute-2")
    worker.start()
    spun.wait(5)
    roles, _ = acct.read()  # while the thread still lives
    release.set()
    worker.join()
    assert roles.get("compute", 0.0) == pytest.approx(0.1, abs=0.03)


def test_another_threads_cpu_clock_reads_its_cpu_not_wall_time():
    spun, release = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (_spin(0.05), spun.set(), release.wait(5)))
    t.start()
    clock = thread_cpu_clock(t.ident)
    assert clock is not None
    try:
        assert spun.wait(5)
        mid = clock()
        assert mid >= 0.05  # its spin, counted
        time.sleep(0.05)  # wall time passing, not ordering: the thread waits on `release` throughout
        assert clock() - mid < 0.02  # blocked: no CPU
    finally:
        release.set()
        t.join()


@pytest.mark.parametrize("path, function, category", [
    ("/x/flowrl/transport/codec.py", "encode", "codec"),
    ("/x/site-packages/msgpack/fallback.py", "pack", "codec"),
    ("/x/flowrl/transport/sender.py", "send", "transport"),
    ("/x/site-packages/zmq/sugar/socket.py", "send_multipart", "transport"),
    ("/x/flowrl/metrics/recorder.py", "drain", "metrics"),
    ("/x/flowrl/weights/publisher.py", "serve", "weight_sync"),
    ("/x/flowrl/runtime/worker/nodestate.py", "publish_snapshot", "weight_sync"),
    ("/x/flowrl/runtime/worker/nodestate.py", "save", "checkpoint"),
    ("/x/flowrl/runtime/protocol/ledger.py", "record", "ledger"),
    ("/x/flowrl/runtime/controller/scheduler.py", "decide", "control"),
    ("/x/flowrl/runtime/worker/compute.py", "start", None),  # plumbing: the caller decides
    ("/x/site-packages/torch/nn/modules/module.py", "_call_impl", None),
    ("/x/nodes/actor.py", "process", None),
])
def test_frames_are_classified_by_module_path(path, function, category):
    assert classify_code(path, function) == category


def _stack(*files: tuple[str, str]):
    """A real chain of frames whose code objects carry the given (filename, function) pairs,
    outermost first; returns the innermost frame."""
    got = {}

    def build(depth: int):
        if depth == len(files):
            got["frame"] = sys._getframe(1)
            return
        filename, function = files[depth]
        ns: dict = {}
        exec(compile(f"def {function}(build, d):\n    build(d)\n", filename, "exec"), ns)
        ns[function](build, depth + 1)

    build(0)
    return got["frame"]


def test_the_innermost_frame_that_names_a_category_decides():
    c = Classifier()
    frame = _stack(("/x/flowrl/runtime/worker/worker.py", "main_loop"),
                   ("/x/flowrl/transport/sender.py", "send"),
                   ("/x/flowrl/transport/codec.py", "encode"),
                   ("/x/site-packages/torch/serialization.py", "helper"))
    assert c.classify(frame) == "codec"
    node_code = _stack(("/x/flowrl/runtime/worker/compute.py", "start"), ("/x/nodes/actor.py", "observe"))
    assert c.classify(node_code, default="other") == "other"
    resting = _stack(("/x/flowrl/runtime/worker/worker.py", "main_loop"), ("/usr/lib/python3/selectors.py", "select"))
    assert c.classify(resting) == UNSEEN


def test_the_switch_turns_the_loop_profiler_and_the_sampler_thread_on_and_off():
    assert sampling_from_env({}) == (True, None)  # by default the loop profiler only
    assert sampling_from_env({"FLOWRL_CPU_SAMPLER": "0"}) == (False, None)
    assert sampling_from_env({"FLOWRL_CPU_SAMPLER": "1"}) == (True, pytest.approx(0.02))
    assert sampling_from_env({"FLOWRL_CPU_SAMPLER": "10"}) == (True, pytest.approx(0.01))
    with pytest.raises(ValueError, match="FLOWRL_CPU_SAMPLER"):
        sampling_from_env({"FLOWRL_CPU_SAMPLER": "fast"})


@linux_only
def test_the_loop_profiler_samples_the_main_thread_where_it_spends_cpu_even_between_socket_calls():
    import os

    from flowrl.metrics.loopprof import LoopProfiler

    r, w = os.pipe()

    def release_the_gil():  # a system call between two stretches of Python work, as a zmq send
        os.write(w, b"x")
        os.read(r, 1)

    prof = LoopProfiler(period_s=0.001)
    assert prof.start()
    try:
        rest = threading.Event()
        end = time.thread_time() + 0.6
        while time.thread_time() < end:
            _busy_in_metrics(0.002)
            release_the_gil()
            rest.wait(0.002)
        got = prof.drain()
    finally:
        prof.stop()
        os.close(r)
        os.close(w)
    assert prof.samples >= 20
    seen = {c: v for c, v in got.items() if c != UNSEEN}
    assert seen.get("metrics", 0.0) / sum(seen.values()) > 0.8


def _busy_in_metrics(seconds: float, then=lambda: None) -> None:  # a frame from flowrl/metrics: this test file's
    code = compile("def drain(spin, s, then):\n    spin(s)\n    then()\n", "/x/flowrl/metrics/hub.py", "exec")
    ns: dict = {}
    exec(code, ns)
    ns["drain"](_spin, seconds, then)


def _ticks(sampler: StackSampler, n: int) -> None:
    """Until the sampler has begun its `n`-th look (a look counts itself before it reads clocks)."""
    deadline = time.monotonic() + 10
    while sampler.ticks < n:
        assert time.monotonic() < deadline, f"the sampler stopped at {sampler.ticks} looks"
        time.sleep(0.001)  # polling its counter, not ordering events


@linux_only
def test_the_sampler_gives_cpu_to_the_category_on_the_stack_and_skips_compute_spans():
    class Compute:  # what ComputeThread shows the sampler
        in_compute, left_compute_cpu = True, 0.0

    state, go, done, release = Compute(), threading.Event(), threading.Event(), threading.Lock()
    release.acquire()

    # it rests inside the metrics frame on a bare lock (a wait in threading.py would be UNSEEN):
    # the sampler's last look, whenever it comes, gives the spin's tail to metrics
    def rest():
        done.set()
        release.acquire(timeout=5)

    def compute_thread():
        go.wait(5)
        _spin(0.15)  # inside a compute span: not the sampler's
        state.left_compute_cpu = time.thread_time()
        state.in_compute = False
        _busy_in_metrics(0.15, then=rest)

    t = threading.Thread(target=compute_thread, name="flowrl-compute-t")
    t.start()
    register_compute_thread(t.ident, state)
    sampler = StackSampler(interval_s=0.005, rescan_s=0.01).start()
    try:
        _ticks(sampler, 1)  # its first look found the thread
        go.set()
        assert done.wait(5)
        _ticks(sampler, sampler.ticks + 2)  # a whole look after `done`: all the thread's CPU read, alive
    finally:
        release.release()
        t.join()
        sampler.stop()
    got = sampler.drain()
    assert got.get(("compute", "metrics"), 0.0) == pytest.approx(0.15, abs=0.01)  # all of it, read alive
    assert sum(v for (role, _), v in got.items() if role == "compute") < 0.2  # the span's 0.15 s left out


def test_recorder_ships_cpu_per_thread_role_and_compute_span_cpu_as_per_node_sums():
    rec = Recorder("actor")
    rec.sample_cpu()
    _spin(0.05)
    rec.add_span("compute", 100.0, 0.2, cpu_s=0.1, batch_id="t1")
    rec.sample_cpu(min_interval_s=0.0)
    snap = rec.drain()
    by = {(m[0], tuple(sorted(m[2].items()))): m[4] for m in snap["metrics"] if m[3]}
    assert by[("span_cpu_s", (("span", "compute"),))] == [pytest.approx(0.1)]
    if sys.platform.startswith("linux"):
        assert by[("cpu_thread_s", (("thread", "loop"),))][0] >= 0.03
    span = next(s for s in snap["spans"] if s[1] == "compute")
    assert span[4]["cpu_ms"] == pytest.approx(100.0)  # in the trace too
    rec.close()


def test_framework_time_is_split_as_sampled_and_unseen_cpu_is_spread_over_the_rest():
    assert split_role(1.0, "loop", {"transport": 0.3, "codec": 0.1, UNSEEN: 5.0}) == \
        pytest.approx({"transport": 0.75, "codec": 0.25})
    assert split_role(1.0, "loop", {}) == {"control": 1.0}
    assert split_role(1.0, "loop", {UNSEEN: 1.0}) == {"control": 1.0}
    b = process_breakdown({"thread/compute": 10.0, "span/compute": 8.0, "thread/loop": 2.0,
                           "thread/zmq": 0.5, "thread/gloo": 0.25, "thread/sampler": 0.25,
                           "process": 13.5, "sampled/compute/weight_sync": 1.0,
                           "sampled/loop/transport": 1.0, "sampled/loop/codec": 1.0})
    assert b["compute_s"] == pytest.approx(8.0)
    assert b["framework_s"] == pytest.approx(5.5)  # 2 outside + 2 loop + .5 + .25 + .25 + .5 ended
    cats = b["categories_s"]
    assert cats["weight_sync"] == pytest.approx(2.25)
    assert cats["transport"] == pytest.approx(1.5) and cats["codec"] == pytest.approx(1.0)
    assert cats["metrics"] == pytest.approx(0.25) and cats["other"] == pytest.approx(0.5)
    assert sum(cats.values()) == pytest.approx(b["framework_s"])


def test_calls_never_hold_more_cpu_than_the_compute_thread_used_over_the_same_rows():
    """A call's span (with its CPU) rides on a ticket, the threads are read on a timer: the rows
    summed can hold a span whose thread CPU was read in a row left out. The compute thread's CPU in
    calls is then its CPU, not more, and a node's CPU stays its process's own total."""
    b = process_breakdown({"thread/compute": 1.0, "span/compute": 3.0, "thread/loop": 0.5, "process": 1.5})
    assert b["compute_s"] == pytest.approx(1.0) and b["framework_s"] == pytest.approx(0.5)
    assert b["cpu_s"] == pytest.approx(b["process_cpu_s"])
    assert b["threads_s"]["compute_outside"] == 0.0


def _row(step: int, **cols) -> dict:
    return {"step": step, "step_time_s": 0.5, **cols}


def test_report_table_adds_up_per_step_and_says_when_a_run_has_no_cpu_data():
    first = _row(1, **{"actor/cpu_thread_s/compute": 99.0})  # start-up: left out
    rows = [first] + [_row(i, **{"actor/cpu_thread_s/compute": 0.3, "actor/span_cpu_s/compute": 0.25,
                                 "actor/cpu_thread_s/loop": 0.05, "actor/cpu_process_s": 0.35,
                                 "controller/cpu_thread_s/loop": 0.02, "controller/cpu_process_s": 0.02})
                      for i in range(2, 12)]
    b = cpu_breakdown(rows)
    a = b["nodes"]["actor"]
    assert b["steps"] == 10 and a["wall_ms"] == pytest.approx(500)
    assert a["compute_ms"] == pytest.approx(250) and a["framework_ms"] == pytest.approx(100)
    assert a["compute_ms"] + a["framework_ms"] + a["idle_ms"] == pytest.approx(a["wall_ms"])
    assert b["total"]["framework_pct"] == pytest.approx(100 * 120 / 370)
    text = "\n".join(breakdown_table(b, ["actor"]))
    assert "framework share of all CPU: 32.4%" in text and "controller" in text
    assert cpu_breakdown([_row(1, reward_mean=0.5), _row(2, reward_mean=0.6)]) is None


def test_flowrl_report_on_a_run_without_cpu_accounting_says_so(synthetic_runs, tmp_path):
    from flowrl.metrics.report import make_report

    paths = make_report(synthetic_runs["actor_bound"], tmp_path / "out")
    assert not any(Path(p).name == "cpu.json" for p in paths)
    assert "this run has no CPU accounting" in (tmp_path / "out" / "summary.txt").read_text()


def test_rows_after_a_nodes_last_cpu_read_are_left_out_of_its_per_step_numbers():
    # spans ride on every completed ticket, thread CPU on a timer: a short run's last rows carry
    # compute spans whose thread CPU no row holds; counting them made compute exceed the process
    read = {"actor/cpu_thread_s/compute": 0.3, "actor/cpu_process_s": 0.3}
    rows = [_row(1)] + [_row(i, **{"actor/span_cpu_s/compute": 0.1, **(read if i % 3 == 0 else {})})
                        for i in range(2, 12)]  # reads at rows 3, 6 and 9 of 2..11
    a = cpu_breakdown(rows)["nodes"]["actor"]
    assert a["steps"] == 8  # rows 2..9
    assert a["compute_ms"] == pytest.approx(100) and a["process_cpu_ms"] == pytest.approx(900 / 8)
    assert a["cpu_ms"] == pytest.approx(a["process_cpu_ms"])


def test_a_sink_reading_cpu_never_starts_the_loop_profilers_timer_itself():
    # Outputs.consume reads CPU with start=False: only the worker's metrics loop starts the loop
    # profiler (a SIGPROF timer). A consume in a process without that loop (a test's) once left the
    # timer armed, and SIGPROF ended the interpreter at exit (pytest's exit status 155)
    import signal

    from flowrl.metrics.recorder import Recorder

    before = signal.getsignal(signal.SIGPROF)
    rec = Recorder(node="actor", replica=0)
    rec.sample_cpu(min_interval_s=0.0, start=False)
    assert rec._cpu is None and signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGPROF) == before
