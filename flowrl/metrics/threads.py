"""CPU seconds per thread of this process, grouped by the thread's role (what it is for).

    acct = ThreadCpu()
    acct.read()     # -> ({"loop": 0.012, "compute": 0.231, "zmq": 0.004, ...}, 0.251)
                    #    seconds per role since the previous read, and the process's own total

Why per thread: a node process is several threads, and "where the cycles go" starts with which
of them spends them. The node's hooks run on its compute thread (`flowrl-compute-*`); channels,
credit, control orders and metrics on the event loop's (the main thread); liveness on
`flowrl-heartbeat`; bytes on ZeroMQ's IO threads (`ZMQbg/*`); weight broadcasts on gloo's
(`gloo_*`, `pt_gloo_*`, `pt_tcpstore*`).

How: /proc/self/task/<tid>/schedstat gives each thread's time on a CPU in nanoseconds (its first
field, the scheduler's own sum); /proc/self/task/<tid>/stat (10 ms ticks) where schedstat is
missing. A read of a dozen threads costs ~0.3 ms; the runtime reads every ~0.5 s. A thread that
ends between two reads loses its last interval from the per-thread sums; the process total
(`time.process_time()`, which keeps the time of ended threads) does not, and the report counts the
difference as `other`.

Python thread names live only inside Python (3.11 does not give them to the OS), so a role comes
from `threading.enumerate()` where the thread is a Python one, else from the OS name. Our own
Python threads also get their OS name set (`/proc/self/task/<tid>/comm`, 15 characters), so
`top -H`, `py-spy` and `perf` tell them apart too; the main thread keeps its name (it is the
process's).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

#: Roles of threads, in the order the report shows them. `torch`: native threads that carry the
#: process's own name (torch's intra-op / OpenMP pools are unnamed), counted as model compute.
ROLES = ("compute", "loop", "heartbeat", "sampler", "pythreads", "zmq", "gloo", "torch", "native")
#: Python threads whose CPU the stack sampler splits into categories (the others have one each).
PY_ROLES = ("compute", "loop", "heartbeat", "sampler", "pythreads")
COMPUTE_PREFIX = "flowrl-compute"
HEARTBEAT_NAME = "flowrl-heartbeat"
SAMPLER_NAME = "flowrl-cpu-sampler"

_TASKS = "/proc/self/task"
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def python_role(name: str) -> str:
    """The role of a Python thread, by its `threading` name."""
    if name == "MainThread":
        return "loop"  # worker and controller both run their event loop on the main thread
    if name.startswith(COMPUTE_PREFIX):
        return "compute"
    if name == HEARTBEAT_NAME:
        return "heartbeat"
    if name == SAMPLER_NAME:
        return "sampler"
    return "pythreads"


def native_role(comm: str, process_comm: str) -> str:
    """The role of a thread Python does not know, by its OS name."""
    if comm.startswith("ZMQbg"):
        return "zmq"
    if comm.startswith(("gloo", "pt_gloo", "pt_tcpstore")):
        return "gloo"
    if comm == process_comm:
        return "torch"
    return "native"


def thread_cpu_clock(ident: int | None) -> Callable[[], float] | None:
    """A function giving the CPU seconds of the Python thread `ident` (any thread may call it:
    CLOCK_THREAD_CPUTIME of another thread of this process, ~1 us); None where unsupported."""
    if ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        clk = time.pthread_getcpuclockid(ident)
        time.clock_gettime(clk)
    except (OSError, OverflowError, ValueError):
        return None

    def read() -> float:
        try:
            return time.clock_gettime(clk)
        except OSError:  # the thread ended
            return 0.0
    return read


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("ascii", "replace")
    except OSError:
        return None


def _task_cpu_s(tasks: str, tid: int) -> float | None:
    got = _read(f"{tasks}/{tid}/schedstat")
    if got:
        return int(got.split()[0]) / 1e9
    got = _read(f"{tasks}/{tid}/stat")
    if not got:
        return None
    fields = got.rsplit(")", 1)[-1].split()  # the name may hold spaces; fields after it are fixed
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def process_cpu_s() -> float:
    """This process's CPU seconds, every thread it ever had included (CLOCK_PROCESS_CPUTIME_ID:
    ns, where os.times() counts 10 ms ticks)."""
    return time.process_time()


class ThreadCpu:
    """Reads every thread's CPU time; `read()` returns seconds per role since the previous read
    (the first read only sets the baseline and returns zeros) and the process total."""

    def __init__(self, tasks_dir: str = _TASKS, name_threads: bool = True):
        self._tasks = tasks_dir
        self._name_threads = name_threads and tasks_dir == _TASKS
        self._last: dict[int, float] = {}
        self._comm: dict[int, str] = {}
        self._named: set[int] = set()
        self._process_comm = (_read(f"/proc/{os.getpid()}/comm") or "python").strip()
        self._last_total: float | None = None
        self.available = os.path.isdir(tasks_dir)

    def roles(self) -> dict[int, str]:
        """OS thread id -> role, for every thread alive now."""
        main = threading.main_thread()
        # Python 3.11 keeps the parent's native_id on the main thread of a forked child (the fork
        # server's), while on Linux the main thread's id is the process id
        py = {(os.getpid() if t is main else t.native_id): t.name for t in threading.enumerate()
              if t.native_id is not None}
        out = {}
        try:
            tids = [int(t) for t in os.listdir(self._tasks)]
        except OSError:
            return out
        for tid in tids:
            name = py.get(tid)
            if name is not None:
                out[tid] = python_role(name)
                if self._name_threads and tid not in self._named and name != "MainThread":
                    self._named.add(tid)
                    self._set_os_name(tid, name)
                continue
            comm = self._comm.get(tid)
            if comm is None:
                comm = self._comm[tid] = (_read(f"{self._tasks}/{tid}/comm") or "").strip()
            out[tid] = native_role(comm, self._process_comm)
        return out

    def _set_os_name(self, tid: int, name: str) -> None:
        short = name.replace("flowrl-", "fl-")[:15]
        try:
            with open(f"{self._tasks}/{tid}/comm", "w") as f:
                f.write(short)
            self._comm[tid] = short
        except OSError:
            pass  # a restricted /proc: the role still comes from the Python name

    def read(self) -> tuple[dict[str, float], float]:
        before = process_cpu_s()
        roles = self.roles()
        first = self._last_total is None
        out: dict[str, float] = {}
        seen: dict[int, float] = {}
        for tid, role in roles.items():
            cpu = _task_cpu_s(self._tasks, tid)
            if cpu is None:
                continue
            seen[tid] = cpu
            if not first:
                delta = cpu - self._last.get(tid, 0.0)  # a thread new since the last read: all of it
                if delta > 0:
                    out[role] = out.get(role, 0.0) + delta
        total = (before + process_cpu_s()) / 2  # the thread reads lie in between
        self._last = seen
        self._comm = {t: c for t, c in self._comm.items() if t in roles}
        d_total = 0.0 if first else max(0.0, total - self._last_total)
        self._last_total = total
        return out, d_total
