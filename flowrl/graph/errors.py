"""Errors of graph files: each problem names the file, the line, the key path, the value and the fix."""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.errors import FlowrlError  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a graph file."""

    path: str  # dotted key path, e.g. "nodes.critic.replicas"
    message: str  # what is wrong, with the bad value
    fix: str = ""  # what to do about it
    file: str | None = None
    line: int | None = None  # 1-based

    def __str__(self) -> str:
        where = self.file or "<graph>"
        if self.line is not None:
            where += f":{self.line}"
        text = f"{where}: {self.path or '<top>'}: {self.message}"
        return f"{text}. Fix: {self.fix}" if self.fix else text


class GraphError(FlowrlError, ValueError):
    """A graph file (or a graph built in Python) cannot be used. Holds every problem found."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"graph has {n} problem{'s' if n != 1 else ''}:"
        super().__init__("\n".join([head, *("  " + str(p) for p in self.problems)]))
