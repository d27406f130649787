"""Errors of graph files: each problem names the file, the line, the key path, the value and the fix.

Messages stay readable whatever the input: a value echoed into a message is cut to `VALUE_CHARS`
(`clip`), a key path to `PATH_CHARS`, a whole problem to `PROBLEM_CHARS`, and a `GraphError` prints
at most `SHOWN_PROBLEMS` of its problems (all of them stay in `.problems`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.errors import FlowrlError  # noqa: F401  (re-exported)

VALUE_CHARS = 200
PATH_CHARS = 200
PROBLEM_CHARS = 1000
SHOWN_PROBLEMS = 10


def clip(text: str, limit: int = VALUE_CHARS) -> str:
    """`text` cut to about `limit` characters, saying how long it was."""
    text = str(text)
    return text if len(text) <= limit else f"{text[: max(limit - 40, 10)]}... ({len(text):,} characters in all)"


def shown(value, limit: int = VALUE_CHARS) -> str:
    """How a message quotes a value from the file (`'abc'`, `3`), cut to about `limit` characters.

    A large container is summarised by its size, never repr'd in full (it may be an alias bomb).
    """
    if isinstance(value, (dict, list, tuple, set)) and len(value) > 20:
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[: max(limit - 40, 10)]!r}... ({len(value):,} characters in all)"
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # a self-referencing structure, or an int too long to print
        return f"<{type(value).__name__}>"
    return clip(text, limit)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a graph file."""

    path: str  # dotted key path, e.g. "nodes.critic.replicas"
    message: str  # what is wrong, with the bad value
    fix: str = ""  # what to do about it
    file: str | None = None
    line: int | None = None  # 1-based

    def __post_init__(self):
        # Bound what one problem can print, whatever a caller put in it (a 1 MB key or value).
        object.__setattr__(self, "path", clip(str(self.path), PATH_CHARS))
        object.__setattr__(self, "message", clip(str(self.message), PROBLEM_CHARS - 300))
        object.__setattr__(self, "fix", clip(str(self.fix), 300))
        if self.file is not None:
            object.__setattr__(self, "file", clip(str(self.file), PATH_CHARS))

    def __str__(self) -> str:
        where = self.file or "<graph>"
        if self.line is not None:
            where += f":{self.line}"
        text = f"{where}: {self.path or '<top>'}: {self.message}"
        return f"{text}. Fix: {self.fix}" if self.fix else text


def problems_text(head: str, problems: list[Problem]) -> str:
    """`head` then the first SHOWN_PROBLEMS problems, one per line, and how many more there are."""
    lines = [head, *("  " + str(p) for p in problems[:SHOWN_PROBLEMS])]
    if len(problems) > SHOWN_PROBLEMS:
        lines.append(f"  ... and {len(problems) - SHOWN_PROBLEMS} more (fix these first)")
    return "\n".join(lines)


class GraphError(FlowrlError, ValueError):
    """A graph file (or a graph built in Python) cannot be used. Holds every problem found."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        n = len(self.problems)
        super().__init__(problems_text(f"graph has {n} problem{'s' if n != 1 else ''}:", self.problems))


def problem_at(located, loc: tuple, message: str, fix: str) -> Problem:
    """A problem at key path `loc` of a loaded file (`located`: its line numbers; None: no file)."""
    file = located.file if located else None
    line = located.line_of(loc) if located else None
    return Problem(".".join(map(str, loc)), message, fix, file, line)
