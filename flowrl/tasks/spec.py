"""Typed configs of the built-in tasks, keyed on ``name`` (no torch import: the graph loader uses it).

In a graph file a task is written as a mapping, for example::

    task: {name: reverse, digits: 4}

and :func:`parse_task_spec` turns it into one of the classes below, rejecting unknown keys with the
list of valid ones.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class _TaskSpecBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    digits: int = Field(4, ge=1, le=32)
    """Digits per operand. Difficulty (and sequence length) grows with it."""


class ReverseSpec(_TaskSpecBase):
    """Write the prompt's digits backwards: ``^R1234=`` -> ``4321$``.

    Needs only attention to one mirrored position per answer digit, so a small model learns it
    from scratch with RL in well under a minute; the default task of ``graphs/ppo.yaml``.
    """

    name: Literal["reverse"] = "reverse"


class SortSpec(_TaskSpecBase):
    """Write the prompt's digits in ascending order: ``^S3141=`` -> ``1134$``.

    Needs more than copying: each answer digit depends on the whole multiset of prompt digits.
    """

    name: Literal["sort"] = "sort"


class AddSpec(_TaskSpecBase):
    """Add two ``digits``-long numbers: ``^A0417+0385=`` -> ``0802$`` (answer reversed by default).

    The answer has ``digits + 1`` digits. Written least-significant digit first (the default), the
    carry flows left to right like the generation does, which makes the task learnable by a small
    model; ``reverse_answer=False`` asks for the usual order and is much harder.
    """

    name: Literal["add"] = "add"
    reverse_answer: bool = True
    """Answer least-significant digit first (True) or most-significant first (False)."""


TaskSpec = Annotated[Union[ReverseSpec, SortSpec, AddSpec], Field(discriminator="name")]
"""Any built-in task config; ``name`` selects the class."""

TASK_NAMES = ("reverse", "sort", "add")

_ADAPTER: TypeAdapter[Any] = TypeAdapter(TaskSpec)


def parse_task_spec(value: Any) -> ReverseSpec | SortSpec | AddSpec:
    """Validate a mapping (or pass a spec through); errors name the bad key and the valid choices."""
    if isinstance(value, (ReverseSpec, SortSpec, AddSpec)):
        return value
    if isinstance(value, dict) and value.get("name") not in TASK_NAMES:
        raise ValueError(
            f"unknown task name {value.get('name')!r}; choose one of {', '.join(TASK_NAMES)} "
            "(for example `task: {name: reverse, digits: 4}`)"
        )
    try:
        return _ADAPTER.validate_python(value)
    except ValidationError as exc:
        raise ValueError(f"invalid task config {value!r}: {exc}") from None
