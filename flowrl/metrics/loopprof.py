"""The event loop's CPU by category, sampled where it runs: a CPU-time timer on the main thread.

    prof = LoopProfiler(period_s=0.001)
    prof.start()          # from the main thread (it installs a SIGPROF handler); False if unsupported
    prof.drain()          # -> {"transport": 0.0121, "codec": 0.0043, ...} CPU seconds

Why not the sampler thread (stacks.py) for the loop: a thread that wants a Python stack must take
the GIL first, and it gets it where the loop gives it up — in epoll, or in a ZeroMQ call. Bursts
of loop work shorter than the GIL's 5 ms switch interval (most of them) are then seen only at
their socket calls or not at all. A timer on the main thread's own CPU clock
(`timer_create(pthread_getcpuclockid(main))`, delivered to that thread with SIGEV_THREAD_ID) fires
while the loop is running, and CPython runs the handler on that thread at its next bytecode, with
the frame it interrupted: samples in proportion to the loop's CPU, where it spends it.

The signal goes to the main thread only, so no other thread's system call is interrupted; on the
main thread CPython retries interrupted calls (PEP 475). Each sample costs a few microseconds and
samples come once per `period_s` of the loop's CPU (the kernel checks CPU timers on its ticks),
so the cost is a fixed share of the loop's CPU: ~1% of it at 1 ms. Linux only (glibc); elsewhere
`start()` returns False and the loop's CPU stays unsplit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import signal
import sys
import threading
import time
from collections import defaultdict
from typing import Any

from flowrl.metrics.stacks import Classifier

log = logging.getLogger(__name__)

SIGEV_THREAD_ID = 4


class _Sigevent(ctypes.Structure):  # glibc's struct sigevent (64 bytes), with the thread id
    _fields_ = [("sigev_value", ctypes.c_void_p), ("sigev_signo", ctypes.c_int),
                ("sigev_notify", ctypes.c_int), ("tid", ctypes.c_int), ("_pad", ctypes.c_int * 11)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class LoopProfiler:
    """Samples the main thread's Python stack once per `period_s` of its CPU time."""

    def __init__(self, period_s: float = 0.001, signum: int = signal.SIGPROF):
        self.period_s = period_s
        self.signum = signum
        self.samples = 0
        self._acc: dict[str, float] = defaultdict(float)
        self._classifier = Classifier()
        self._last_cpu = 0.0
        self._timer: Any = None
        self._librt: Any = None
        self._old_handler: Any = None

    def start(self) -> bool:
        if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
            return False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            ev = _Sigevent(sigev_signo=self.signum, sigev_notify=SIGEV_THREAD_ID,
                           tid=threading.get_native_id())
            clock = time.pthread_getcpuclockid(threading.get_ident())
            timer = ctypes.c_void_p()
            if libc.timer_create(ctypes.c_int(clock), ctypes.byref(ev), ctypes.byref(timer)) != 0:
                raise OSError(ctypes.get_errno(), "timer_create")
            self._old_handler = signal.signal(self.signum, self._on_signal)
            sec, nsec = divmod(int(self.period_s * 1e9), 1_000_000_000)
            spec = _Itimerspec(_Timespec(sec, nsec), _Timespec(sec, nsec))
            self._last_cpu = time.thread_time()
            if libc.timer_settime(timer, 0, ctypes.byref(spec), None) != 0:
                raise OSError(ctypes.get_errno(), "timer_settime")
        except (OSError, AttributeError, ValueError) as e:
            log.debug("no loop profiler here: %s", e)
            return False
        self._librt, self._timer = libc, timer
        return True

    def _on_signal(self, signum: int, frame: Any) -> None:
        cpu = time.thread_time()  # we are on the main thread
        delta, self._last_cpu = cpu - self._last_cpu, cpu
        self._acc[self._classifier.classify(frame, default="control")] += max(0.0, delta)
        self.samples += 1

    def drain(self) -> dict[str, float]:
        """CPU seconds per category since the previous drain (call it on the main thread: the
        handler runs there too, so no lock is needed)."""
        out, self._acc = dict(self._acc), defaultdict(float)
        return out

    def stop(self) -> None:
        if self._timer is not None:
            self._librt.timer_delete(self._timer)
            self._timer = None
            if threading.current_thread() is threading.main_thread():
                signal.signal(self.signum, self._old_handler or signal.SIG_DFL)
