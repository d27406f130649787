"""Rewards as configuration: a list of weighted terms, each a typed config keyed on `type`.

    terms:
      - {type: math, weight: 1.0}                                   # final answer right?
      - {type: format, weight: 0.2, pattern: '\\s*-?\\d+\\s*'}         # answer only, nothing else
      - {type: length, weight: 1.0, buffer: 4}                      # DAPO soft overlong penalty
      - {type: code, weight: 1.0, cpu_s: 2, memory_mb: 512}         # run the tests in the sandbox
      - {type: reasoning_gym}                                       # the item's own checker

    >>> specs = parse_terms([{"type": "math"}, {"type": "format", "pattern": r"\\d+", "weight": 0.5}])
    >>> score_terms(specs, Inputs(responses=["12"], references=["12"], lengths=[3], max_tokens=8))
    ({'math': [1.0], 'format': [1.0]}, [1.5])

The score of a response is ``sum(weight * term)``; each term's own mean is reported as a metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Term(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = 1.0
    """Multiplies the term (negative: a penalty)."""
    name: str | None = None
    """Metric name (`reward_<name>_mean`); default: the type (numbered when repeated)."""


class MathTerm(_Term):
    """1 when the response's final answer (boxed, after ####, or the last number) equals the reference."""

    type: Literal["math"] = "math"


class FormatTerm(_Term):
    """1 when a regular expression matches the stripped response."""

    type: Literal["format"] = "format"
    pattern: str
    """Python regex (DOTALL), e.g. `'<think>.*</think>.*\\\\boxed\\{.*\\}'`."""
    mode: Literal["fullmatch", "match", "search"] = "fullmatch"


class LengthTerm(_Term):
    """DAPO overlong shaping: 0, then down to -1 over the last `buffer` tokens of the budget."""

    type: Literal["length"] = "length"
    buffer: int = Field(4, ge=1)
    """Tokens before the budget where the penalty ramps."""
    max_tokens: int | None = Field(None, ge=1)
    """The budget; default: the batch's `max_new_tokens`."""


class CodeTerm(_Term):
    """Fraction of test cases the response's program passes, run in the sandbox (flowrl.rewards.sandbox)."""

    type: Literal["code"] = "code"
    cpu_s: float = Field(2.0, gt=0)
    wall_s: float = Field(5.0, gt=0)
    memory_mb: int = Field(512, ge=32)
    max_procs: int = Field(8, ge=1)
    all_or_nothing: bool = False
    workers: int = Field(2, ge=1)
    """Programs run at once."""
    require_isolation: bool = False
    """Refuse to run code when no network / pid namespace can be made (only the audit hook)."""


class ReasoningGymTerm(_Term):
    """reasoning-gym's own checker of the item (dataset `format: reasoning_gym`, `answer_field: entry`);
    the answer is the text inside the last `<answer>...</answer>`, else the whole response."""

    type: Literal["reasoning_gym"] = "reasoning_gym"


TermSpec = Annotated[MathTerm | FormatTerm | LengthTerm | CodeTerm | ReasoningGymTerm, Field(discriminator="type")]
_TERMS: TypeAdapter[Any] = TypeAdapter(list[TermSpec])


def parse_terms(value: Any) -> list:
    return _TERMS.validate_python(value)


@dataclass
class Inputs:
    responses: list[str]
    """Decoded responses (up to their EOS)."""
    references: list[str]
    """Reference answers, one per response."""
    lengths: list[int]
    """Response tokens, EOS included."""
    max_tokens: int
    """The generation budget of the batch."""


def term_names(specs: list) -> list[str]:
    names, seen = [], {}
    for s in specs:
        base = s.name or s.type
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}{seen[base]}")
    return names


def score_term(spec, x: Inputs) -> list[float]:
    if spec.type == "math":
        from flowrl.rewards.math import math_scores

        return math_scores(x.responses, x.references)
    if spec.type == "format":
        from flowrl.rewards.shaping import format_scores

        return format_scores(x.responses, spec.pattern, spec.mode)
    if spec.type == "length":
        from flowrl.rewards.shaping import overlong_penalty

        return overlong_penalty(x.lengths, spec.max_tokens or x.max_tokens, min(spec.buffer, spec.max_tokens or x.max_tokens))
    if spec.type == "reasoning_gym":
        from flowrl.rewards.gym import reasoning_gym_scores

        return reasoning_gym_scores(x.responses, x.references)
    from flowrl.rewards.code import code_scores
    from flowrl.rewards.sandbox import Limits

    limits = Limits(cpu_s=spec.cpu_s, wall_s=spec.wall_s, memory_mb=spec.memory_mb, max_procs=spec.max_procs)
    return code_scores(x.responses, x.references, limits, all_or_nothing=spec.all_or_nothing, workers=spec.workers,
                       require_isolation=spec.require_isolation)


def score_terms(specs: list, x: Inputs) -> tuple[dict[str, list[float]], list[float]]:
    """Each term's scores by name, and the weighted total per response."""
    per = {name: score_term(s, x) for name, s in zip(term_names(specs), specs)}
    total = [sum(s.weight * per[n][i] for n, s in zip(per, specs)) for i in range(len(x.responses))]
    return per, total
