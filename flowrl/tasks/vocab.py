"""The shared token vocabulary of the built-in tasks.

Every built-in task speaks the same 18 tokens, so one model (``TinyLMSpec.vocab_size = 18``) can be
trained on any of them, or on a mix. Digits map to their own value (token 7 is the digit 7), which
keeps printed token tensors readable. Pure Python on purpose: the graph loader imports this module
and must not pull in torch.

    >>> encode("12+34=")
    [1, 2, 10, 3, 4, 11]
    >>> decode([BOS, REV, 4, 2, SEP])
    '^R42='
"""

from __future__ import annotations

from collections.abc import Iterable

DIGITS = tuple(range(10))
"""Token ids of the digits 0-9: the id is the digit."""
PLUS = 10
"""Separates the operands of an addition prompt."""
SEP = 11
"""Ends every prompt: the answer starts after it (printed ``=``)."""
BOS = 12
"""Starts every prompt."""
EOS = 13
"""Ends an answer; a task scores only what comes before it."""
PAD = 14
"""Fills a response after its EOS; never sampled by a trained policy, never scored."""
REV = 15
"""Task marker: reverse the digits."""
SORT = 16
"""Task marker: sort the digits ascending."""
ADD = 17
"""Task marker: add the two operands."""
VOCAB_SIZE = 18
"""Number of token ids; the default ``vocab_size`` of the built-in model."""

_SYMBOLS = "0123456789+=^$_RSA"
assert len(_SYMBOLS) == VOCAB_SIZE


def decode(tokens: Iterable[int]) -> str:
    """Render token ids as one character each (``^`` BOS, ``$`` EOS, ``_`` PAD, ``R/S/A`` markers)."""
    out = []
    for tok in tokens:
        tok = int(tok)
        if not 0 <= tok < VOCAB_SIZE:
            raise ValueError(f"token id {tok} is outside the task vocabulary 0-{VOCAB_SIZE - 1}")
        out.append(_SYMBOLS[tok])
    return "".join(out)


def encode(text: str) -> list[int]:
    """Inverse of :func:`decode`: one token id per character."""
    try:
        return [_SYMBOLS.index(ch) for ch in text]
    except ValueError:
        bad = sorted(set(text) - set(_SYMBOLS))
        raise ValueError(f"characters {bad} are not in the task vocabulary {_SYMBOLS!r}") from None
