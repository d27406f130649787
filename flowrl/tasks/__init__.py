"""Procedurally generated tasks with verifiable, partial-credit rewards (nothing is downloaded).

    >>> task = build_task({"name": "reverse", "digits": 4})
    >>> prompts, targets = task.prompts(seed=0, index=0, n=8)    # [8, 7], [8, 4] int64
    >>> rewards = task.score(responses, targets)                  # doctest: +SKIP

The specs and the vocabulary import without torch (the graph loader and ``flowrl check`` use
them); the task classes load torch when :func:`build_task` is first called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowrl.tasks.spec import (
    TASK_NAMES,
    AddSpec,
    LongTailSpec,
    ReverseSpec,
    SortSpec,
    TaskSpec,
    parse_task_spec,
)
from flowrl.tasks.vocab import (
    ADD,
    BOS,
    EOS,
    PAD,
    PLUS,
    REV,
    SEP,
    SORT,
    VOCAB_SIZE,
    decode,
    encode,
)

if TYPE_CHECKING:
    from flowrl.tasks.base import Task

__all__ = [
    "ADD", "BOS", "EOS", "PAD", "PLUS", "REV", "SEP", "SORT", "VOCAB_SIZE", "TASK_NAMES",
    "AddSpec", "LongTailSpec", "ReverseSpec", "SortSpec", "TaskSpec",
    "build_task", "decode", "encode", "parse_task_spec",
]


def build_task(spec: Any) -> "Task":
    """The task for a spec or a mapping such as ``{"name": "sort", "digits": 5}``."""
    spec = parse_task_spec(spec)
    from flowrl.tasks import digits, longtail

    cls = {"reverse": digits.ReverseTask, "sort": digits.SortTask, "add": digits.AddTask,
           "longtail": longtail.LongTailTask}[spec.name]
    return cls(spec)


def __getattr__(name: str) -> Any:
    if name == "Task":
        from flowrl.tasks.base import Task

        return Task
    raise AttributeError(f"module 'flowrl.tasks' has no attribute {name!r}")
