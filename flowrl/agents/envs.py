"""Two multi-turn environments the built-in tiny model learns from random weights by RL on a CPU.

    >>> env = CalcEnv()
    >>> env.reset({"index": 0, "seed": 5})           # 3-digit x 3-digit, shown as text
    '...*...'                                                                   # doctest: +SKIP
    >>> env = resolve_env("guess")()                  # built-in name, or "pkg.mod:Class"

``calc`` (:class:`CalcEnv`): a tool task. The model is shown ``a*b%7`` (two random 3-digit
numbers; the answer is one digit) -- which a model of a few hundred thousand parameters cannot
compute, but can look up: a turn starting with ``=`` is a call of the ``calc`` tool (the char
format's compact form, see ``flowrl.agents.chat``); ``=`` alone asks about the question on screen
(the env's ``prepare_call`` hook fills in the expression), ``=EXPR`` evaluates EXPR. The tool's
answer comes back as the next message; copying it is the answer. A successful episode, in
characters (the model's turns in brackets; a turn ends at EOS ``$`` or at ``max_new_tokens``)::

    ^417*382%7\n [=$] 3\n [3$]

Why this shape: every decision the model must discover by sampling is one character (call, then
copy the digit the tool gave), so RL from random weights finds it within a few hundred steps on
a CPU (benchmarks/agent_learn.py); copying a whole 6-digit product (``modulus: null``) is the same
skill six times over and takes far longer from scratch with a 102-character vocabulary.
Reward: ``call_weight`` (0.2) for the first call, half of it when its answer is not the
question's (through the env's ``on_tools`` hook), plus ``answer_weight`` (0.8) x the share of the
answer's digits right, position by position (extra digits count as wrong). Guessing without the
tool scores about 0.8 / 7 (``modulus`` 7); 1.0 = called and copied.

``guess`` (:class:`GuessEnv`): a task that needs the environment's feedback. A hidden digit
0-9; each model turn is a guess (its first character), the environment answers ``<`` (the
hidden digit is lower), ``>`` (higher) or ``?`` (not a digit). Reward 1 when the guess is right
(the episode ends), 0 when ``max_guesses`` (5) guesses missed. Binary search always finds it
within 4, blind guessing about a third of the time, so the reward measures how well the model
uses what the earlier turns revealed::

    ^?\\n [5] >\\n [8] <\\n [7]          -> reward 1   (max_new_tokens: 1, one character a turn)

Both are pure functions of ``task["seed"]``: a replayed ticket gets the same episodes (the agent
node gives every sample of a task the same task seed, so a GRPO group shares one problem).
"""

from __future__ import annotations

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

    def __init__(self, digits: int = 3, modulus: int | None = 7, call_weight: float = 0.2,
                 answer_weight: float = 0.8):
        if digits < 1:
            raise ValueError(f"digits={digits}; operands need at least one digit")
        if modulus is not None and not 2 <= modulus <= 10:
            raise ValueError(f"modulus={modulus}; give 2..10 (a one-digit answer) or null (the whole product)")
        self.digits, self.modulus = digits, modulus
        self.call_weight, self.answer_weight = call_weight, answer_weight
        self.question, self.answer, self.called = "", "", False

    def reset(self, task: dict[str, Any]) -> str:
        rng = _rng(task)
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if self.modulus is None:
            self.question, self.answer = f"{a}*{b}", str(a * b)
        else:
            self.question, self.answer = f"{a}*{b}%{self.modulus}", str(a * b % self.modulus)
        self.called = False
        return self.question

    def prepare_call(self, call):
        """``=`` alone (an empty expression) asks about the question on screen."""
        if call.name == "calc" and not str(call.arguments.get("expr", "")).strip():
            return type(call)(call.name, {**call.arguments, "expr": self.question}, call.id)
        return call

    def on_tools(self, calls, results) -> float:
        if self.called:
            return 0.0  # only the first call is scored
        self.called = True
        right = results[0].ok and results[0].content.strip() == self.answer
        return self.call_weight * (1.0 if right else 0.5)

    def step(self, text: str) -> Step:
        share = positional_share(re.match(r"\s*(\d*)", text).group(1), self.answer)
        return Step(reward=self.answer_weight * share, done=True, info={"answer_share": share})


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
    from flowrl.agents.tools import resolve_named

    return resolve_named(name, BUILTIN_ENVS, "env", "Class")
