"""The built-in digit tasks: reversal, sorting and multi-digit addition.

    >>> from flowrl.tasks import build_task, decode
    >>> task = build_task({"name": "reverse", "digits": 4})
    >>> prompts, targets = task.prompts(seed=0, index=0, n=1)
    >>> decode(prompts[0]), decode(targets[0])
    ('^R4183=', '3814')
"""

from __future__ import annotations

import torch

from flowrl.tasks.base import Task, seeded_digits
from flowrl.tasks.spec import AddSpec, ReverseSpec, SortSpec
from flowrl.tasks.vocab import ADD, BOS, PLUS, REV, SEP, SORT


def _frame(marker: int, body: torch.Tensor) -> torch.Tensor:
    """``[n, L]`` digits -> ``[n, L + 3]`` prompt ``BOS marker body SEP``."""
    n = body.shape[0]
    head = torch.tensor([BOS, marker], dtype=torch.long).expand(n, 2)
    return torch.cat([head, body, torch.full((n, 1), SEP, dtype=torch.long)], dim=1)


class _OneOperandTask(Task):
    """A prompt of `digits` digits whose answer is a rearrangement of them (same length)."""

    marker: int

    def __init__(self, spec: ReverseSpec | SortSpec) -> None:
        self.spec = spec

    @property
    def prompt_len(self) -> int:
        return self.spec.digits + 3

    @property
    def answer_len(self) -> int:
        return self.spec.digits

    def answer(self, digits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prompts(self, seed: int, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        digits = torch.from_numpy(seeded_digits(seed, index, n, self.spec.digits))
        return _frame(self.marker, digits), self.answer(digits).contiguous()


class ReverseTask(_OneOperandTask):
    """``^R1234=`` -> ``4321``."""

    marker = REV

    def answer(self, digits: torch.Tensor) -> torch.Tensor:
        return digits.flip(1)


class SortTask(_OneOperandTask):
    """``^S3141=`` -> ``1134``."""

    marker = SORT

    def answer(self, digits: torch.Tensor) -> torch.Tensor:
        return digits.sort(dim=1).values


class AddTask(Task):
    """``^A0417+0385=`` -> ``0802`` (= 802 reversed, with its carry digit) by default."""

    def __init__(self, spec: AddSpec) -> None:
        self.spec = spec

    @property
    def prompt_len(self) -> int:
        return 2 * self.spec.digits + 4

    @property
    def answer_len(self) -> int:
        return self.spec.digits + 1

    def prompts(self, seed: int, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.spec.digits
        digits = torch.from_numpy(seeded_digits(seed, index, n, 2 * d))  # [n, 2d]
        a, b = digits[:, :d], digits[:, d:]
        # Schoolbook addition from the least significant digit, carry kept per row: exact for any
        # number of digits (no int64 overflow at digits=32).
        carry = torch.zeros(n, dtype=torch.long)
        low_first = []
        for i in range(d - 1, -1, -1):
            total = a[:, i] + b[:, i] + carry
            low_first.append(total % 10)
            carry = total // 10
        low_first.append(carry)
        answer = torch.stack(low_first, dim=1)  # [n, d+1], least significant first
        if not self.spec.reverse_answer:
            answer = answer.flip(1)
        body = torch.cat([a, torch.full((n, 1), PLUS, dtype=torch.long), b], dim=1)
        return _frame(ADD, body), answer.contiguous()
