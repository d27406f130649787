"""Which part of the framework spends a thread's CPU: a statistical sampler of Python stacks,
weighted by the CPU each thread used since the previous sample.

    sampler = StackSampler(interval_s=0.005).start()
    ...
    sampler.drain()   # -> {("loop", "codec"): 0.012, ("loop", "transport"): 0.031, ...} seconds

Every `interval_s` the sampler reads each Python thread's CPU clock (~1 us a thread); a thread
that used no CPU since the last look (waiting in epoll, on a lock, in sleep) costs nothing more.
For one that did, it takes the thread's stack (`sys._current_frames()`) and gives that CPU to the
category of the stack (`classify`). The compute thread is skipped while it is inside a `compute`
span (the node's own work, measured exactly elsewhere: `register_compute_thread`). Sums are
therefore CPU seconds, not sample counts; the report scales them to each thread's exact CPU
(threads.py), so the sampler only decides the split.

Limits: to read a stack the sampler must hold the GIL, and it gets it where the sampled thread
gives it up (a system call, a lock, every 5 ms at most), so short bursts of Python work are seen
at their socket calls or not at all. The event loop's thread, whose work comes in such bursts, is
sampled by the loop profiler instead (loopprof.py, on by default); this thread samples the compute
thread outside spans and other Python threads, whose work (snapshots, broadcasts) runs longer.
Cost: each look is a thread wake-up (~50-80 us on a 2-core VM), ~2% of graphs/grpo.yaml's CPU,
so it runs only with FLOWRL_CPU_SAMPLER=1; its own thread is the `sampler` role of the per-thread
accounting, so every report shows what it cost.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from types import FrameType
from typing import Any

from flowrl.metrics.threads import SAMPLER_NAME, python_role, thread_cpu_clock

#: Framework categories, in the order the report shows them.
CATEGORIES = ("transport", "codec", "ledger", "metrics", "weight_sync", "checkpoint", "control",
              "other")
ENV = "FLOWRL_CPU_SAMPLER"
DEFAULT_INTERVAL_S = 0.02
#: Threads the sampler looks at; the heartbeat's little CPU is control, its own is metrics.
SAMPLED_ROLES = ("compute", "loop", "pythreads")

#: (path fragment, function names or None for any, category). A stack is walked from its
#: innermost frame outwards; the first frame that a rule names decides (the codec inside a send
#: is codec, the send around it transport). Modules no rule names (torch, asyncio, anyio, the
#: node's own code, the compute thread's plumbing) pass the question on to their caller.
RULES: tuple[tuple[str, tuple[str, ...] | None, str], ...] = (
    ("/flowrl/transport/codec.py", None, "codec"),
    ("/flowrl/transport/wire.py", None, "codec"),
    ("/flowrl/transport/batch.py", None, "codec"),
    ("/flowrl/transport/ragged.py", None, "codec"),
    ("/flowrl/transport/dtypes.py", None, "codec"),
    ("/msgpack/", None, "codec"),
    ("/flowrl/transport/", None, "transport"),
    ("/zmq/", None, "transport"),
    ("/flowrl/metrics/", None, "metrics"),
    ("/flowrl/weights/", None, "weight_sync"),
    ("/flowrl/runtime/worker/weightsync.py", None, "weight_sync"),
    ("/flowrl/runtime/worker/syncs.py", None, "weight_sync"),
    ("/flowrl/runtime/worker/version.py", None, "weight_sync"),
    ("/flowrl/runtime/controller/weightorders.py", None, "weight_sync"),
    ("/flowrl/runtime/worker/nodestate.py", ("publish", "publish_snapshot", "drain_weights",
                                             "serve_weights"), "weight_sync"),
    ("/flowrl/runtime/worker/nodestate.py", None, "checkpoint"),
    ("/flowrl/runtime/protocol/checkpoints.py", None, "checkpoint"),
    ("/flowrl/runtime/protocol/ledger.py", None, "ledger"),
    ("/flowrl/runtime/worker/compute.py", None, None),  # the compute thread's plumbing: ask the caller
    ("/flowrl/runtime/worker/runner.py", None, None),
    ("/flowrl/runtime/", None, "control"),
)

_compute_threads: dict[int, weakref.ref] = {}


def register_compute_thread(ident: int | None, thread: Any) -> None:
    """The runtime's compute thread (`ComputeThread`): its `in_compute` says that it is inside a
    `compute` span (then its CPU is the node's, counted exactly by the span, and the sampler
    leaves it alone) and `left_compute_cpu` its CPU clock where the last span ended (so a look
    after a span counts only what came after it)."""
    alive = {t.ident for t in threading.enumerate()}
    for gone in [i for i in _compute_threads if i not in alive]:  # ended threads' idents get reused
        del _compute_threads[gone]
    if ident is not None:
        _compute_threads[ident] = weakref.ref(thread)


def _norm(path: str) -> str:
    return path.replace("\\", "/")


def classify_code(filename: str, function: str) -> str | None:
    """The category one frame names, or None when it leaves the question to its caller."""
    path = _norm(filename)
    for fragment, functions, category in RULES:
        if fragment in path and (functions is None or function in functions):
            return category
    return None


#: A thread whose innermost frame is one of these waits (in epoll, on a lock or a queue): the CPU
#: it used since the previous look went to work the sampler did not see. It is kept as UNSEEN and
#: the report spreads it over the categories the sampler did see on that thread (an unbiased
#: estimate: a look lands in work in proportion to the work's CPU).
AT_REST = ("/selectors.py", "/threading.py", "/queue.py")
UNSEEN = "unseen"


class Classifier:
    """`classify(frame)` with a cache per code object (a stack walk is then a few dict lookups)."""

    def __init__(self) -> None:
        self._cache: dict[object, str | None] = {}

    def classify(self, frame: FrameType | None, default: str = "other") -> str:
        if frame is None:
            return default
        if _norm(frame.f_code.co_filename).endswith(AT_REST):
            return UNSEEN
        cache = self._cache
        while frame is not None:
            code = frame.f_code
            try:
                got = cache[code]
            except KeyError:
                got = cache[code] = classify_code(code.co_filename, code.co_name)
            if got is not None:
                return got
            frame = frame.f_back
        return default


def sampling_from_env(env: dict[str, str] | None = None) -> tuple[bool, float | None]:
    """(loop profiler on, thread sampler interval or None) from FLOWRL_CPU_SAMPLER:
    unset = the loop profiler only (loopprof.py: ~0.1% of the run's CPU), "0"/"off" = neither,
    "1"/"on" = both, the sampler thread every DEFAULT_INTERVAL_S; a number greater than 1 = both,
    the sampler thread every that many milliseconds (it costs ~2% of the run's CPU)."""
    raw = (os.environ if env is None else env).get(ENV, "").strip().lower()
    if raw == "":
        return True, None
    if raw in ("0", "off", "false", "no"):
        return False, None
    if raw in ("1", "on", "true", "yes"):
        return True, DEFAULT_INTERVAL_S
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: use 0 (off), 1 (on, the sampler thread every "
                         f"{DEFAULT_INTERVAL_S * 1e3:g} ms) or the sampler thread's interval in "
                         f"milliseconds (e.g. 10); unset = the event loop's profiler only") from None
    return True, max(ms, 1.0) / 1e3


class StackSampler:
    """A daemon thread attributing the CPU of this process's Python threads to CATEGORIES."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, rescan_s: float = 1.0,
                 max_interval_s: float = 0.08, roles: tuple[str, ...] = SAMPLED_ROLES):
        self.interval_s = interval_s
        self.roles = roles  # without "loop" where the loop profiler (loopprof.py) samples it
        self._max_interval_s = max(interval_s, max_interval_s)
        self._rescan_s = rescan_s
        self._lock = threading.Lock()
        self._acc: dict[tuple[str, str], float] = defaultdict(float)
        self._classifier = Classifier()
        self._stop = False
        self.ticks = 0
        self.walks = 0
        self._thread = threading.Thread(target=self._run, name=SAMPLER_NAME, daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        self._stop = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def drain(self) -> dict[tuple[str, str], float]:
        """CPU seconds per (thread role, category) since the previous drain."""
        with self._lock:
            out, self._acc = dict(self._acc), defaultdict(float)
        return out

    def _targets(self) -> dict[int, tuple[str, Callable[[], float], Any]]:
        me = threading.get_ident()
        out = {}
        for t in threading.enumerate():
            role = python_role(t.name)
            if t.ident is None or t.ident == me or role not in self.roles:
                continue
            clock = thread_cpu_clock(t.ident)
            if clock is not None:
                ref = _compute_threads.get(t.ident)
                out[t.ident] = (role, clock, ref() if ref is not None else None)
        return out

    def _run(self) -> None:
        targets, last, rescan_at = {}, {}, 0.0
        classify = self._classifier.classify
        interval = self.interval_s
        while not self._stop:
            time.sleep(interval)
            now = time.monotonic()
            if now >= rescan_at:
                targets, rescan_at = self._targets(), now + self._rescan_s
                last = {i: last.get(i, clock()) for i, (_, clock, _) in targets.items()}
            self.ticks += 1
            frames = None
            for ident, (role, clock, compute) in targets.items():
                cpu = clock()
                if compute is not None:
                    if compute.in_compute:  # the node's own work: the span counts it exactly
                        last[ident] = cpu
                        continue
                    last[ident] = max(last[ident], compute.left_compute_cpu)  # not the span's tail
                delta, last[ident] = cpu - last[ident], cpu
                if delta <= 0:
                    continue
                if frames is None:
                    frames = sys._current_frames()
                    self.walks += 1
                category = classify(frames.get(ident))
                with self._lock:
                    self._acc[(role, category)] += delta
            # nothing ran but the node's own compute: look less often (each look is a thread
            # wake-up, ~50 us); anything else ran: look at the base rate again
            interval = self.interval_s if frames is not None else min(interval * 2, self._max_interval_s)
