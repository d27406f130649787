"""The first moments of a node process, whichever launcher started it: tie its life to its
parent's, point its output at its log, run its entry module's `main([spec_path])`."""

from __future__ import annotations

import importlib
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: have the kernel send `sig` to this process when its parent exits."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        pass


def run_child(entry: str, spec_path: str, log_path: str) -> None:
    """In a freshly forked node process: logs to its file, then `entry.main`; never returns."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the controller, which stops us
    code = 1
    try:
        code = importlib.import_module(entry).main([spec_path])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
