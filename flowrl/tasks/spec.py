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


class LongTailSpec(BaseModel):
    """Answers of widely varying length: ``^012=`` -> ``123456789012$`` (count to 12, last digits).

    Answers are long-tailed like real reasoning traces: the length is a clipped log-normal, so most
    answers are a few tokens long and a few run to ``max_len`` -- a batch generated at once waits
    for its longest sample (what ``benchmarks/async.py`` measures). Stopping at the right length
    needs the model to compare its position with the prompt's count, which absolute positions
    (``positions: learned``) make learnable; the digits depend on the position only.

    The score is partial credit twice over: per correct position (answer and EOS, as for every
    task) and for the length alone, so stopping at about the right place pays before the digits do.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["longtail"] = "longtail"
    max_len: int = Field(200, ge=1, le=999)
    """Longest answer (digits; its EOS not counted): lengths are clipped to it. The rollout's
    ``max_new_tokens`` is ``max_len + 1`` and the model's ``max_seq_len`` must hold the prompt too."""
    median_len: float = Field(8.0, ge=1)
    """Median answer length: ``exp(mu)`` of the log-normal."""
    sigma: float = Field(1.2, ge=0)
    """Spread of the log-normal (std of the log length). 1.2 with median 8: p90 ~ 37, p99 ~ 130
    tokens, and about 0.4% of the answers are clipped at ``max_len = 200``."""
    answer: Literal["count", "repeat"] = "count"
    """``count``: the last digits of 1, 2, ..., n (``^012=`` -> ``123456789012``). ``repeat``: a
    digit given in the prompt, n times (``^7012=`` -> ``777777777777``); harder for RL: the digit
    must be copied from the prompt, which the built-in 2 x 64 model had not learned after 400
    steps of ``graphs/grpo-longtail.yaml`` (it learned the lengths, and wrote one digit throughout)."""
    length_weight: float = Field(0.5, ge=0, le=1)
    """Share of the score that rewards the length alone: ``min(E, A + 1) / max(E, A + 1)`` for ``E``
    tokens emitted (EOS included) against ``A`` digits + EOS wanted. The rest is the per-position
    credit of the other tasks. 0 scores like them."""


TaskSpec = Annotated[Union[ReverseSpec, SortSpec, AddSpec, LongTailSpec], Field(discriminator="name")]
"""Any built-in task config; ``name`` selects the class."""

TASK_NAMES = ("reverse", "sort", "add", "longtail")

_ADAPTER: TypeAdapter[Any] = TypeAdapter(TaskSpec)


def parse_task_spec(value: Any) -> ReverseSpec | SortSpec | AddSpec | LongTailSpec:
    """Validate a mapping (or pass a spec through); errors name the bad key and the valid choices."""
    if isinstance(value, (ReverseSpec, SortSpec, AddSpec, LongTailSpec)):
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
