"""The terminal view of `flowrl run`: a rich panel on a terminal, plain log lines elsewhere.

    with LiveView(hub, graph_summary) as view:
        while running:
            ...
            view.update()          # cheap to call often: redraws at most every `interval_s`

On a TTY the panel (step, reward, throughput, per-node state / busy / waits / CPU / memory /
GPU, queue depth per edge, staleness, restarts) redraws in place. When stdout is not a TTY (CI,
`> log.txt`) the same numbers are printed as one line every `interval_s` (default 10 s), plus a
final line on exit — a log a person can read and a script can grep.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from flowrl.metrics.render import GraphSummary, plain_line, rich_view

if TYPE_CHECKING:
    from flowrl.metrics.hub import MetricsHub

__all__ = ["LiveView", "GraphSummary"]

log = logging.getLogger(__name__)


class LiveView:
    """`plain=None` decides by `stream.isatty()`; `clock` is injectable for tests.

    `status_dir=RUN_DIR` also rewrites RUN_DIR/status.json about every `status_interval_s` from
    `update()` (phase "starting" until the first step, then "running"), so `flowrl status` stays
    fresh through start-up and long steps; the final status (finished / failed) is the caller's."""

    def __init__(self, hub: MetricsHub, graph_summary: Any = None, *, stream: IO[str] | None = None,
                 plain: bool | None = None, interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 status_dir: str | os.PathLike | None = None, status_interval_s: float = 1.0):
        self.hub = hub
        self.graph = GraphSummary.coerce(graph_summary)
        self._summary = graph_summary if isinstance(graph_summary, dict) else None  # total_steps may grow
        self.stream = stream if stream is not None else sys.stdout
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.plain = (not isatty()) if plain is None else plain
        self.interval_s = interval_s if interval_s is not None else (10.0 if self.plain else 0.25)
        self._clock = clock
        self._last: float | None = None
        self._last_line = ""
        self._live: Any = None
        self.status_dir = status_dir
        self.status_interval_s = status_interval_s
        self._last_status: float | None = None

    def start(self) -> LiveView:
        if not self.plain and self._live is None:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream)
            own_terminal = self.stream is sys.stdout  # then print() lands above the panel
            self._live = Live(self._render(), console=console, auto_refresh=False, transient=False,
                              redirect_stdout=own_terminal, redirect_stderr=own_terminal)
            self._live.start(refresh=True)
            self._last = self._clock()
        return self

    def state(self) -> dict[str, Any]:
        total = (self._summary or {}).get("total_steps")
        if total is not None and total != self.graph.total_steps:  # tickets added in place of replaced ones
            self.graph = dataclasses.replace(self.graph, total_steps=total)
        state = self.hub.live_state()
        state["graph"] = self.graph.to_dict()
        return state

    def _render(self) -> Any:
        return rich_view(self.state(), self.graph)

    def update(self, force: bool = False) -> None:
        """Redraw (or print one line) unless the last one is younger than `interval_s`."""
        now = self._clock()
        if self.status_dir is not None and (self._last_status is None
                                            or now - self._last_status >= self.status_interval_s):
            self._last_status = now
            self.write_status()
        if not force and self._last is not None and now - self._last < self.interval_s:
            return
        self._last = now
        if self.plain:
            line = plain_line(self.state(), self.graph)
            if force and line == self._last_line:
                return  # the final line would repeat the one just printed
            self._last_line = line
            self.stream.write(line + "\n")
            self.stream.flush()
        elif self._live is not None:
            self._live.update(self._render(), refresh=True)

    def write_status(self) -> None:
        from flowrl.metrics.status import write_status

        phase = "running" if self.hub.last_row is not None else "starting"
        try:
            write_status(self.status_dir, self.hub.live_state(), phase=phase, graph=self.graph)
        except OSError as e:  # a full disk must not stop the run; the next tick tries again
            log.warning("cannot write %s/status.json: %s", self.status_dir, e)

    def stop(self) -> None:
        """Final redraw / final line, then release the terminal."""
        if self.plain:
            self.update(force=True)
        elif self._live is not None:
            self._live.update(self._render(), refresh=True)
            self._live.stop()
            self._live = None

    def __enter__(self) -> LiveView:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
