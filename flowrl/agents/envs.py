"""Two multi-turn environments the built-in tiny model learns from random weights by RL on a CPU.

    >>> env = CalcEnv()
    >>> env.reset({"index": 0, "seed": 5})           # 3-digit x 3-digit, shown as text
    '...*...'                                                                   # doctest: +SKIP
    >>> env = resolve_env("guess")()                  # built-in name, or "pkg.mod:Class"

``calc`` (:class:`CalcEnv`): a tool task. The model is shown ``a*b`` (two 3-digit numbers) and
must answer the product (its leading digits are read) -- which a model of a few hundred thousand parameters cannot compute, but
can look up: a turn ``=EXPR`` is a call of the ``calc`` tool (the char format's compact form, see
``flowrl.agents.chat``), whose answer comes back as the next message; copying it is the answer.
The whole successful episode, in characters (``$`` = EOS, the model's turns in brackets)::

    ^417*382\\n [=417*382$] 159294\\n [159294$]

Reward, shaped so that sampling from scratch finds each skill in turn, and 1.0 only for a
right answer after a right call:

- ``call_weight`` (0.5) x (1/2 for calling at all + 1/2 x the first call's expression against the
  question, character by character, a quarter for a digit where a digit belongs:
  :func:`char_credit`), given through the env's ``on_tools`` hook;
- ``answer_weight`` (0.5) x the share of the product's digits the answer has right (position by
  position; extra characters count as wrong) x the call's share of the question (``gate``): the
  answer is worth what the call it copies was worth, so while the calls are still junk the
  answers' lucky digits add no noise to the call's signal, and answering without a call scores 0;
- ``copy_weight`` (0 by default) x the share of the tool's answer the model repeats x the call's
  share (an optional extra for honest reporting).

``guess`` (:class:`GuessEnv`): a task that needs the environment's feedback. A hidden digit
0-9; each model turn is a guess (its first character), the environment answers ``<`` (the
hidden digit is lower), ``>`` (higher) or ``?`` (not a digit). Reward 1 when the guess is right
(the episode ends), 0 when ``max_guesses`` (5) guesses missed. Binary search always finds it
within 4, blind guessing about a third of the time, so the reward measures how well the model
uses what the earlier turns revealed::

    ^?\\n [5$] >\\n [8$] <\\n [7$]          -> reward 1

Both are pure functions of ``task["seed"]``: a replayed ticket gets the same episodes (the agent
node gives every sample of a task the same task seed, so a GRPO group shares one problem).
"""

from __future__ import annotations

import importlib
import random
import re
from typing import Any

from flowrl.agents.base import Step


def _rng(task: dict[str, Any]) -> random.Random:
    return random.Random(int(task.get("seed", 0)) * 1_000_003 + int(task.get("index", 0)))


def positional_share(got: str, want: str) -> float:
    """Share of ``want``'s characters ``got`` has at the same positions (extra characters count
    as wrong: divided by the longer of the two)."""
    if not want:
        return float(not got)
    hits = sum(a == b for a, b in zip(got, want))
    return hits / max(len(want), len(got))


class CalcEnv:
    """The tool task (see the module docstring)."""

    tools = ("calc",)
    """Tools the task is meant to be played with (the agent node's default)."""

    def __init__(self, digits: int = 3, call_weight: float = 0.5, copy_weight: float = 0.0,
                 answer_weight: float = 0.5, gate: bool = True):
        if digits < 1:
            raise ValueError(f"digits={digits}; operands need at least one digit")
        self.digits = digits
        self.call_weight, self.copy_weight, self.answer_weight = call_weight, copy_weight, answer_weight
        self.gate = gate
        self.expr, self.answer, self.result, self.call_share = "", "", None, 0.0

    def reset(self, task: dict[str, Any]) -> str:
        rng = _rng(task)
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        self.expr, self.answer, self.result, self.call_share = f"{a}*{b}", str(a * b), None, 0.0
        return self.expr

    def on_tools(self, calls, results) -> float:
        if self.result is not None:
            return 0.0  # only the first call is scored
        self.result = results[0].content if results[0].ok else ""
        self.call_share = positional_share(str(calls[0].arguments.get("expr", "")), self.expr)
        return self.call_weight * (0.5 + 0.5 * char_credit(str(calls[0].arguments.get("expr", "")), self.expr))

    def step(self, text: str) -> Step:
        got = re.match(r"\s*(\d*)", text).group(1)
        share = positional_share(got, self.answer)
        copied = positional_share(got, self.result) if self.result else 0.0
        gate = self.call_share if self.gate else 1.0
        return Step(reward=self.answer_weight * share * gate + self.copy_weight * self.call_share * copied, done=True,
                    info={"answer_share": share})


def char_credit(got: str, want: str) -> float:
    """Like :func:`positional_share`, with a quarter for a character of the right kind (a digit
    where a digit belongs) at a wrong value: what lets sampling find the shape before the values."""
    if not want:
        return float(not got)
    score = sum(1.0 if a == b else 0.25 * (a.isdigit() == b.isdigit()) for a, b in zip(got, want))
    return score / max(len(want), len(got))


class GuessEnv:
    """The feedback task (see the module docstring)."""

    tools = ()

    def __init__(self, max_guesses: int = 5, high: int = 9):
        if not 1 <= high <= 9:
            raise ValueError(f"high={high}; the hidden number is one digit, 1..9")
        self.max_guesses, self.high = max_guesses, high
        self.hidden, self.guesses = 0, 0

    def reset(self, task: dict[str, Any]) -> str:
        self.hidden, self.guesses = _rng(task).randint(0, self.high), 0
        return "?"

    def step(self, text: str) -> Step:
        self.guesses += 1
        guess = text[:1]
        if guess == str(self.hidden):
            return Step(reward=1.0, done=True, info={"guesses": self.guesses})
        if self.guesses >= self.max_guesses:
            return Step(reward=0.0, done=True, info={"guesses": self.guesses})
        hint = "?" if not guess.isdigit() else ("<" if self.hidden < int(guess) else ">")
        return Step(messages=[{"role": "user", "content": hint}])


BUILTIN_ENVS = {"calc": CalcEnv, "guess": GuessEnv}


def resolve_env(name: str) -> type:
    """A built-in environment (``calc``, ``guess``) or ``"pkg.mod:Class"``."""
    if name in BUILTIN_ENVS:
        return BUILTIN_ENVS[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(f"env {name!r}: give a built-in environment ({', '.join(BUILTIN_ENVS)}) or a class "
                         "as 'package.module:Class'")
    cls = getattr(importlib.import_module(module), attr, None)
    if cls is None:
        raise ValueError(f"env {name!r}: module {module!r} has no {attr!r}")
    return cls
