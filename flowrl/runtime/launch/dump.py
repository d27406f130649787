"""`flowrl status RUN_DIR --dump`: every node process of a running job on this host writes what it
waits on into its log (worker.py `dump_state`: its tasks' stacks, its channels' counters, its input
policies' queues). For a run that makes no progress and says nothing: the logs then show which
process holds what."""

from __future__ import annotations

import json
import signal
import socket
import sys
from pathlib import Path


def dump_processes(run_dir: str | Path) -> int:
    import psutil

    procs = Path(run_dir) / "procs"
    if not procs.is_dir():
        print(f"flowrl status --dump: {run_dir} has no procs/ folder; is it the run directory of a job?", file=sys.stderr)
        return 2
    host, sent = socket.gethostname(), []
    for path in sorted(procs.glob("*.pid")):
        try:
            info = json.loads(path.read_text())
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid <= 1:
            continue
        if info.get("host") != host:
            print(f"  {info.get('proc', path.stem)}: on host {info.get('host')}, not here; skipped")
            continue
        try:  # only the flowrl process that wrote the file (pids are reused; SIGUSR1 ends most others)
            target = psutil.Process(pid)
            cmd, started = " ".join(target.cmdline()), target.create_time()
            written = path.stat().st_mtime
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            continue
        if "flowrl" not in cmd or not written - 600 <= started <= written + 1:
            continue
        try:
            target.send_signal(signal.SIGUSR1)  # psutil checks it is still the process it looked at
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        sent.append(info.get("proc", path.stem))
        print(f"  {info.get('proc', path.stem)} (pid {pid}) -> {Path(run_dir) / 'logs' / (path.stem + '.log')}")
    if not sent:
        print(f"flowrl status --dump: no live node process of {run_dir} on this host", file=sys.stderr)
        return 1
    print(f"flowrl status --dump: {len(sent)} process(es) write their state into their logs")
    return 0
