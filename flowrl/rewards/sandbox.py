"""Run untrusted code (a model's answer) in a subprocess it cannot escape: time, memory, processes,
output size and network all bounded.

    >>> r = run_sandboxed("print(int(input()) * 2)", stdin="21\\n")
    >>> r.status, r.stdout
    ('ok', '42\\n')
    >>> run_sandboxed("while True: pass", limits=Limits(cpu_s=1)).status
    'cpu'

Layers, each enough on its own for its resource:
- namespaces (``unshare --net --pid --fork --kill-child``, as root; else an unprivileged user
  namespace ``unshare -r``): a fresh network namespace has only a down loopback, so nothing --
  not 127.0.0.1 either -- is reachable; a fresh pid namespace dies as a whole with its first
  process, so nothing the code forks outlives the run;
- rlimits in the child: RLIMIT_CPU (SIGXCPU, then SIGKILL), RLIMIT_AS (memory: MemoryError),
  RLIMIT_NPROC (with privileges dropped to `nobody` so the kernel enforces it), RLIMIT_FSIZE
  (stdout/stderr go to files, capped), no core files, 64 file descriptors;
- a wall-clock timeout: the whole process group is SIGKILLed;
- an audit hook (``sys.addaudithook``) that refuses sockets, fork/exec/spawn, signals and ctypes
  at the Python level (the only network guard when no namespace can be made: ``isolation``
  says which layers were in force).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

BOOT = Path(__file__).with_name("_sandbox_boot.py")
NOBODY = 65534


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 2.0
    """CPU seconds per process (SIGXCPU at the limit, SIGKILL a second later)."""
    wall_s: float = 5.0
    """Wall-clock seconds for the whole run; then every process of it is killed."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS); allocations beyond it raise MemoryError."""
    max_procs: int = 8
    """Processes of the sandbox user (RLIMIT_NPROC): a fork bomb stops here."""
    max_output_bytes: int = 1 << 20
    """Bytes of stdout (and of stderr) kept; a process writing more is killed (SIGXFSZ)."""
    guard: bool = True
    """Also refuse sockets, fork/exec, signals and ctypes at the Python level (audit hook)."""


@dataclass
class SandboxResult:
    status: str
    """ok | error (non-zero exit) | timeout (wall) | cpu | memory | output (too much) | killed"""
    stdout: str
    stderr: str
    exit_code: int | None
    seconds: float
    isolation: str
    """namespace | user-namespace | none (only the audit hook keeps the network out)"""


@lru_cache(maxsize=1)
def isolation_mode() -> str:
    """The strongest isolation this machine allows (probed once per process)."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return "none"
    for mode, flags in (("namespace", []), ("user-namespace", ["-r"])):
        try:
            ok = subprocess.run([unshare, *flags, "-n", "-p", "-f", "--kill-child", "true"],
                                capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return mode
    return "none"


def _command(mode: str, work: str, limits: Limits) -> list[str]:
    payload = {**asdict(limits), "memory_bytes": limits.memory_mb << 20,
               "drop_to_uid": NOBODY if mode == "namespace" and os.getuid() == 0 else None}
    cmd = [sys.executable, "-I", str(BOOT), work, json.dumps(payload)]
    if mode == "namespace":
        return ["unshare", "-n", "-p", "-f", "--kill-child", *cmd]
    if mode == "user-namespace":
        return ["unshare", "-r", "-n", "-p", "-f", "--kill-child", *cmd]
    return cmd


def run_sandboxed(code: str, stdin: str = "", *, limits: Limits = Limits(), require_isolation: bool = False) -> SandboxResult:
    """Run Python source ``code`` with ``stdin``; see the module docstring for what bounds it."""
    mode = isolation_mode()
    if require_isolation and mode == "none":
        raise RuntimeError("no network / pid namespace can be created here (unshare failed), and "
                           "require_isolation is set; run as root, allow unprivileged user namespaces "
                           "(sysctl kernel.unprivileged_userns_clone=1), or accept the audit-hook guard")
    work = tempfile.mkdtemp(prefix="flowrl-sandbox-")
    try:
        os.chmod(work, 0o755)
        cwd = os.path.join(work, "cwd")
        os.mkdir(cwd)
        os.chmod(cwd, 0o777)  # the sandbox user may write scratch files here (RLIMIT_FSIZE bounds them)
        Path(work, "solution.py").write_text(code, encoding="utf-8")
        Path(work, "stdin.txt").write_text(stdin, encoding="utf-8")
        t0 = time.monotonic()
        with open(Path(work, "stdin.txt"), "rb") as fin, open(Path(work, "stdout.txt"), "wb") as fout, \
                open(Path(work, "stderr.txt"), "wb") as ferr:
            proc = subprocess.Popen(_command(mode, work, limits), stdin=fin, stdout=fout, stderr=ferr,
                                    start_new_session=True, close_fds=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill(proc, mode)
        seconds = time.monotonic() - t0
        out = _read(Path(work, "stdout.txt"), limits.max_output_bytes)
        err = _read(Path(work, "stderr.txt"), limits.max_output_bytes)
        status_file = Path(work, "status.json")
        code_ = json.loads(status_file.read_text())["exit"] if status_file.exists() else None
        return SandboxResult(_status(timed_out, code_, err), out, err, code_, seconds, mode)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _kill(proc: subprocess.Popen, mode: str) -> None:
    """End the run and everything it started before returning.

    In a pid namespace, killing its first process (the boot reaper, unshare's child) makes the
    kernel kill every process in it, and that process's exit waits until they are all gone; unshare
    waits for it. So kill that one first and wait for unshare: then nothing is left. The session's
    process group is killed as well (and is all there is without namespaces)."""
    if mode != "none" and proc.poll() is None:
        import psutil

        try:
            for child in psutil.Process(proc.pid).children():
                child.kill()
            proc.wait(timeout=5)
        except (psutil.Error, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _status(timed_out: bool, code: int | None, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if code is None:
        return "killed"
    if code == 0:
        return "ok"
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu"
    if code == -signal.SIGXFSZ or "File too large" in stderr:  # Python ignores SIGXFSZ: the write fails
        return "output"
    if "MemoryError" in stderr:
        return "memory"
    return "error"
