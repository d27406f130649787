"""Launchers start node processes; the worker code does not care which one did.

`local` (default): processes on this host, forked from a fork server that has already imported
torch and the worker, so a restarted node is running in well under the ~1.5 s a fresh
`import torch` costs. `subprocess`: plain `python -m flowrl.runtime.worker` (no preloading).
A `ray` launcher plugs into the same seam.

Every handle is ended by PID: SIGTERM, a bounded wait, SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path


class ProcessHandle(ABC):
    pid: int

    @abstractmethod
    def poll(self) -> int | None:
        """Exit code (negative: killed by that signal), or None while running."""

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (SIGCONT first, in case it is stopped), wait, then SIGKILL."""
        if self.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.poll() is None:
            self.signal(signal.SIGKILL)
            deadline = time.monotonic() + 5
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        return self.poll()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Launcher(ABC):
    @abstractmethod
    def start(self, spec_path: Path, log_path: Path) -> ProcessHandle: ...

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
class _MPHandle(ProcessHandle):
    def __init__(self, proc):
        self.proc = proc
        self.pid = proc.pid

    def poll(self) -> int | None:
        return self.proc.exitcode


def _child(spec_path: str, log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the controller, which stops us
    from flowrl.runtime.worker import main

    code = main([spec_path])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class LocalLauncher(Launcher):
    """Fork-server launcher: the server imports torch + the worker once; each node forks from it."""

    def __init__(self, preload: bool = True):
        import multiprocessing as mp

        self.ctx = mp.get_context("forkserver")
        if preload:
            self.ctx.set_forkserver_preload(["flowrl.runtime.worker", "torch", "flowrl.metrics", "flowrl.transport"])

    def start(self, spec_path: Path, log_path: Path) -> ProcessHandle:
        proc = self.ctx.Process(target=_child, args=(str(spec_path), str(log_path)), daemon=False)
        proc.start()
        return _MPHandle(proc)


# ---------------------------------------------------------------------------------------------
class _PopenHandle(ProcessHandle):
    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()


class SubprocessLauncher(Launcher):
    """A fresh interpreter per node process (slower start, nothing shared)."""

    def start(self, spec_path: Path, log_path: Path) -> ProcessHandle:
        log = open(log_path, "ab")
        try:
            popen = subprocess.Popen([sys.executable, "-m", "flowrl.runtime.worker", str(spec_path)],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        finally:
            log.close()
        return _PopenHandle(popen)


def make_launcher(kind: str) -> Launcher:
    if kind == "local":
        return LocalLauncher()
    if kind == "subprocess":
        return SubprocessLauncher()
    if kind == "ray":
        raise NotImplementedError("the ray launcher is not part of this release yet; use launcher: {type: local}")
    raise ValueError(f"unknown launcher {kind!r}; use local or subprocess")
