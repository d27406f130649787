"""`procs/<process>.pid` in the run directory: what `flowrl status --dump` signals (on this host)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from flowrl.runtime.protocol.procspec import ProcSpec


def pid_file(spec: ProcSpec) -> Path:
    """`procs/<process>.pid` in the run directory: what `flowrl status --dump` signals (on this host)."""
    return Path(spec.home) / "procs" / f"{spec.log_name}.pid"


def write_pid_file(spec: ProcSpec) -> None:
    import json
    import socket

    with contextlib.suppress(OSError):  # a run directory this host cannot write (another host's)
        pid_file(spec).parent.mkdir(parents=True, exist_ok=True)  # its own host folder (launcher.host_dirs)
        pid_file(spec).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "proc": spec.proc_id,
                                    "incarnation": spec.incarnation}))
