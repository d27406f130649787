"""The long-tail task: answers from 1 to ``max_len`` tokens, most short, a few very long.

    >>> from flowrl.tasks import build_task, decode
    >>> task = build_task({"name": "longtail"})
    >>> prompts, targets = task.prompts(seed=0, index=0, n=1)
    >>> decode(prompts[0]), decode(targets[0, :4])
    ('^003=', '123_')

A batch generated at once waits for its slowest sample: with the defaults the longest answer of 16
prompts is typically 63 tokens against a median of 8, so a batch decoded until its last sample is
done runs about 5 times the sequence-steps its answers need, as with real reasoning traces. Targets are ``[n, max_len]``, each
answer right-padded with PAD, so batches of any prompts concatenate (see ``partial_credit``).
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.tasks.base import Task, emitted_lengths, partial_credit, seeded_digits, seeded_uniform
from flowrl.tasks.spec import LongTailSpec
from flowrl.tasks.vocab import BOS, PAD, SEP


class LongTailTask(Task):
    """``^012=`` -> ``123456789012`` (``answer: count``) or ``^7012=`` -> ``777777777777`` (``repeat``).

    The prompt is BOS, (for ``repeat``: the digit,) the length in ``count_digits`` digits, SEP.
    """

    def __init__(self, spec: LongTailSpec) -> None:
        self.spec = spec
        self.count_digits = len(str(spec.max_len))

    @property
    def prompt_len(self) -> int:
        return self.count_digits + (3 if self.spec.answer == "repeat" else 2)

    @property
    def answer_len(self) -> int:
        return self.spec.max_len

    def lengths(self, seed: int, index: int, n: int) -> np.ndarray:
        """Answer lengths ``[n]`` (int64, 1..max_len) of prompts ``index .. index + n - 1``.

        A log-normal of median ``median_len`` and log-std ``sigma`` (Box-Muller on two hashed
        uniforms per prompt), rounded and clipped to ``1..max_len``.
        """
        u = seeded_uniform(seed, index, n, 3)  # column 0 is the digit's (seeded_digits), 1-2 the length's
        z = np.sqrt(-2.0 * np.log(u[:, 1])) * np.cos(2.0 * np.pi * u[:, 2])
        raw = np.rint(self.spec.median_len * np.exp(self.spec.sigma * z))
        return np.clip(raw, 1, self.spec.max_len).astype(np.int64)

    def prompts(self, seed: int, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.from_numpy(self.lengths(seed, index, n))  # [n]
        place = 10 ** torch.arange(self.count_digits - 1, -1, -1)  # most significant digit first
        count = (lengths[:, None] // place[None]) % 10  # [n, count_digits]
        pos = torch.arange(self.spec.max_len)
        if self.spec.answer == "repeat":
            digit = torch.from_numpy(seeded_digits(seed, index, n, 1))  # [n, 1]
            body, answer = torch.cat([digit, count], dim=1), digit.expand(n, self.spec.max_len)
        else:  # the last digit of 1, 2, ..., n
            body, answer = count, ((pos + 1) % 10)[None].expand(n, self.spec.max_len)
        head = torch.full((n, 1), BOS, dtype=torch.long)
        prompts = torch.cat([head, body, torch.full((n, 1), SEP, dtype=torch.long)], dim=1)
        targets = torch.where(pos[None] < lengths[:, None], answer, PAD)  # [n, max_len], PAD after each answer
        return prompts, targets.contiguous()

    def score(self, responses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Rewards ``[n]`` in [0, 1]: ``length_weight`` x length credit + the rest x per-position credit.

        Length credit is ``min(E, A + 1) / max(E, A + 1)`` (``E`` tokens emitted, EOS included; ``A``
        digits wanted): 1 for the right length whatever the digits, 1/2 for half or twice as long.
        The exact answer scores 1; a response that never stops scores little on both.
        """
        positions = partial_credit(responses, targets)
        w = self.spec.length_weight
        if w == 0:
            return positions
        emitted = emitted_lengths(responses).float()
        wanted = ((targets != PAD).sum(dim=1) + 1).float()  # digits before the padding, + EOS
        length = torch.minimum(emitted, wanted) / torch.maximum(emitted, wanted)
        return w * length + (1 - w) * positions
