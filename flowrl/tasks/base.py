"""What every task provides, the seeded digit source, and the partial-credit score they share.

A task is a pure function of ``(seed, index)``: ``task.prompts(seed, index, n)`` returns prompts
number ``index .. index + n - 1`` of the stream named by ``seed``, whatever the batch size, so a
replayed work ticket (same seed and cursor) gets the very same prompts in any process. The digits
come from a counter-based hash (splitmix64 of seed, prompt number and position), not from a
stateful generator, which is what makes that hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from flowrl.tasks.vocab import EOS, PAD, VOCAB_SIZE

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # uint64 array arithmetic wraps modulo 2**64, which is what the hash needs.
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seeded_bits(seed: int, index: int, n: int, length: int) -> np.ndarray:
    """Hashed words ``[n, length]`` (uint64) of prompts ``index .. index + n - 1`` of stream ``seed``.

    Row ``i`` depends only on ``(seed, index + i)``: ``seeded_bits(s, 5, 1, L)`` equals row 5 of
    ``seeded_bits(s, 0, 8, L)``, and column ``j`` of a row does not depend on ``length``.
    """
    for name, value in (("seed", seed), ("index", index)):
        if not 0 <= value < 2**63:
            raise ValueError(f"{name} must be in 0..2**63-1, got {value}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    stream = _splitmix64(np.array([seed], dtype=np.uint64))
    rows = _splitmix64(stream ^ _splitmix64(np.arange(index, index + n, dtype=np.uint64)))
    return _splitmix64(rows[:, None] + _GOLDEN * np.arange(1, length + 1, dtype=np.uint64)[None])


def seeded_digits(seed: int, index: int, n: int, length: int) -> np.ndarray:
    """Digits ``[n, length]`` (int64, 0-9) of prompts ``index .. index + n - 1`` of stream ``seed``.

    Row ``i`` depends only on ``(seed, index + i)``: ``seeded_digits(s, 5, 1, L)`` equals row 5 of
    ``seeded_digits(s, 0, 8, L)``.
    """
    return (seeded_bits(seed, index, n, length) % np.uint64(10)).astype(np.int64)


def seeded_uniform(seed: int, index: int, n: int, length: int) -> np.ndarray:
    """Floats ``[n, length]`` in the open interval (0, 1), from the same hash as :func:`seeded_digits`."""
    top = (seeded_bits(seed, index, n, length) >> np.uint64(11)).astype(np.float64)  # 53 random bits
    return (top + 0.5) / float(2**53)


def emitted_lengths(responses: torch.Tensor) -> torch.Tensor:
    """Tokens ``[n]`` (int64) of each response ``[n, T]`` up to and including its first EOS; ``T`` when none."""
    is_eos = responses == EOS
    return torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, responses.shape[1])


def partial_credit(responses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Score ``[n]`` in [0, 1]: matching positions of answer + EOS over the longer of the two.

    ``responses [n, T]`` are the generated tokens after the prompt; only tokens up to and
    including the first EOS count (the rest is padding). ``targets [n, A]`` are the answer digits,
    right-padded with PAD where answers differ in length (the long-tail task): row ``i``'s answer
    is its tokens before the first PAD. The EOS that must follow an answer is one more position to
    get right. With ``E`` tokens emitted (``T`` when no EOS came) and an answer of ``A_i`` digits the
    score is ``matches / max(E, A_i + 1)``: the exact answer scores 1, every wrong, missing or extra
    token costs one position, and a uniformly random policy scores about ``1 / VOCAB_SIZE`` -- a
    signal from the very first step.
    """
    if responses.dim() != 2 or targets.dim() != 2 or responses.shape[0] != targets.shape[0]:
        raise ValueError(
            f"responses must be [n, T] and targets [n, A] with the same n; got "
            f"{tuple(responses.shape)} and {tuple(targets.shape)}"
        )
    n, t_len = responses.shape
    is_pad = targets == PAD
    a_lens = torch.where(is_pad.any(dim=1), is_pad.int().argmax(dim=1), targets.shape[1])  # [n]
    want = torch.cat([targets, torch.full((n, 1), PAD, dtype=targets.dtype)], dim=1)  # [n, A+1]
    want[torch.arange(n), a_lens] = EOS  # answer, EOS, then PAD (never matched: cut at the EOS)
    emitted = emitted_lengths(responses)  # [n]
    width = min(t_len, want.shape[1])
    pos = torch.arange(width)
    # a sampled PAD before the EOS must not match the padding of a shorter answer: only positions
    # up to the answer's EOS count
    live = (pos[None] < emitted[:, None]) & (pos[None] <= a_lens[:, None])
    hits = (responses[:, :width] == want[:, :width]) & live
    return hits.sum(dim=1).float() / torch.maximum(emitted, a_lens + 1).float()


class Task(ABC):
    """A procedurally generated task with a verifiable reward.

    Prompts of one task all have the same length ``prompt_len`` (no padding, so no attention mask
    anywhere downstream), answers the same length ``answer_len``.
    """

    vocab_size: int = VOCAB_SIZE

    @property
    @abstractmethod
    def prompt_len(self) -> int:
        """Tokens per prompt, BOS and SEP included."""

    @property
    @abstractmethod
    def answer_len(self) -> int:
        """Digits per answer (the EOS after them not counted)."""

    @property
    def max_new_tokens(self) -> int:
        """Generation budget that fits the answer and its EOS."""
        return self.answer_len + 1

    @abstractmethod
    def prompts(self, seed: int, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts ``[n, prompt_len]`` and targets ``[n, answer_len]`` (int64), numbers ``index..index+n-1``."""

    def score(self, responses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Rewards ``[n]`` in [0, 1] for responses ``[n, T]`` (tokens after the prompt); see :func:`partial_credit`."""
        return partial_credit(responses, targets)
