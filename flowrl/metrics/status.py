"""`flowrl status RUN_DIR`: look at a running job from another terminal.

The controller writes RUN_DIR/status.json about once a second:

    write_status(run_dir, hub.live_state(), phase="running", graph=graph_summary)
    ...
    write_status(run_dir, hub.live_state(), phase="finished")      # or "failed", with error=...

The file is replaced atomically (write temp, rename), so a reader never sees half of it, and it
holds the same live state the controller's own terminal view draws (see live_state.py); the
reader adds how fresh it is and whether the controller process is still alive, so a crashed run
reads "stale" instead of pretending to run.

    show_status(run_dir)                # print once; exit code 0, 1 when there is no status
    show_status(run_dir, follow=True)   # redraw until the run ends or Ctrl-C
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

from flowrl.metrics.render import GraphSummary, fmt_time, plain_line, rich_view

STATUS_FILE = "status.json"
PHASES = ("starting", "running", "finished", "failed", "stopped")


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_status(run_dir: str | os.PathLike, state: dict[str, Any], *, phase: str = "running",
                 graph: Any = None, **extra: Any) -> Path:
    """Atomically replace RUN_DIR/status.json with `state` + phase, graph, writer pid and time."""
    if phase not in PHASES:
        raise ValueError(f"status phase {phase!r} is not one of {PHASES}")
    run_dir = Path(run_dir)
    doc = dict(state)
    doc.update(extra)
    doc.update(phase=phase, written_t=time.time(), pid=doc.get("pid", os.getpid()))
    if graph is not None:
        doc["graph"] = GraphSummary.coerce(graph).to_dict()
    path, tmp = run_dir / STATUS_FILE, run_dir / f".{STATUS_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(_clean(doc), allow_nan=False), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_status(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The last status written, or None when there is none (yet)."""
    path = Path(run_dir) / STATUS_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); it is written atomically by the "
                         f"controller, so another program wrote it") from e


def _alive(pid: Any) -> bool | None:
    if not isinstance(pid, int):
        return None
    try:
        import psutil

        return psutil.pid_exists(pid)
    except Exception:
        return None


def liveness(doc: dict[str, Any], now: float | None = None, stale_after_s: float = 5.0) -> str:
    """One line: phase, age of the status, and whether the controller still lives."""
    now = time.time() if now is None else now
    phase = doc.get("phase", "?")
    age = max(0.0, now - float(doc.get("written_t") or now))
    line = f"{phase} (updated {fmt_time(age)} ago, controller pid {doc.get('pid', '?')})"
    if phase in ("running", "starting") and age > stale_after_s:
        alive = _alive(doc.get("pid"))
        line = (f"stale: no update for {fmt_time(age)} and controller pid {doc.get('pid')} is "
                f"{'gone - the run ended without writing a final status' if alive is False else 'alive but silent (hung?)'}")
    if doc.get("error"):
        line += f" - error: {doc['error']}"
    return line


def show_status(run_dir: str | os.PathLike, *, follow: bool = False, stream: IO[str] | None = None,
                plain: bool | None = None, interval_s: float = 1.0,
                stale_after_s: float = 5.0) -> int:
    """Print the live state of the run in RUN_DIR; returns a process exit code (0 ok,
    1 no status file, 2 stale: the controller stopped writing it while 'running')."""
    stream = stream if stream is not None else sys.stdout
    plain = (not getattr(stream, "isatty", lambda: False)()) if plain is None else plain
    run_dir = Path(run_dir)
    doc = read_status(run_dir)
    if doc is None:
        stream.write(f"no status in {run_dir} ({STATUS_FILE} not found): the run has not started "
                     f"yet, or was not started by `flowrl run` with this run directory\n")
        return 1

    def draw(doc: dict[str, Any]) -> Any:
        head = f"{run_dir}: {liveness(doc, stale_after_s=stale_after_s)}"
        return head + "\n" + plain_line(doc) if plain else rich_view(doc, title=head)

    def code(doc: dict[str, Any]) -> int:
        return 2 if liveness(doc, stale_after_s=stale_after_s).startswith("stale") else 0

    if plain:
        stream.write(draw(doc) + "\n")
        stream.flush()
        while follow and doc.get("phase") in ("running", "starting") and code(doc) == 0:
            time.sleep(interval_s)
            doc = read_status(run_dir) or doc
            stream.write(plain_line(doc) + "\n")
            stream.flush()
        return code(doc)
    from rich.console import Console
    from rich.live import Live

    console = Console(file=stream)
    if not follow:
        console.print(draw(doc))
        return code(doc)
    try:
        with Live(draw(doc), console=console, auto_refresh=False) as live:
            while doc.get("phase") in ("running", "starting") and code(doc) == 0:
                time.sleep(interval_s)
                doc = read_status(run_dir) or doc
                live.update(draw(doc), refresh=True)
    except KeyboardInterrupt:
        pass
    return code(doc)
