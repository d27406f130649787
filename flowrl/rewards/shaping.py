"""Format and length terms: a regex on the response, DAPO's soft overlong penalty.

    >>> format_scores(["<think>..</think> 42", "42"], r"<think>.*</think>.*", mode="match")
    [1.0, 0.0]
    >>> overlong_penalty([10, 14, 16], max_tokens=16, buffer=4)   # DAPO eq. 13
    [0.0, -0.5, -1.0]
"""

from __future__ import annotations

import re


def format_scores(responses: list[str], pattern: str, mode: str = "fullmatch") -> list[float]:
    """1.0 where ``pattern`` matches the (stripped) response: `fullmatch`, `match` (at the start) or `search`."""
    rx = re.compile(pattern, re.DOTALL)
    fn = {"fullmatch": rx.fullmatch, "match": rx.match, "search": rx.search}[mode]
    return [float(fn(r.strip()) is not None) for r in responses]


def overlong_penalty(lengths: list[int], max_tokens: int, buffer: int) -> list[float]:
    """0 up to ``max_tokens - buffer`` tokens, then falling linearly to -1 at ``max_tokens``.

    DAPO (Yu et al. 2025, "overlong reward shaping"): a response that runs into the length limit
    is probably truncated; a graded penalty in the last ``buffer`` tokens says so without the
    noise of a cliff. Lengths are response tokens including the EOS.
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"the overlong buffer ({buffer}) must be in 1..max_tokens ({max_tokens})")
    free = max_tokens - buffer
    return [0.0 if n <= free else max(-1.0, (free - n) / buffer) for n in lengths]
