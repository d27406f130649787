"""Which dataset rows a ticket gets: a pure function of (seed, ticket, dataset size).

    >>> rows_for_ticket(seed=0, index=3, size=4, n_rows=10)      # epoch 1 starts inside this ticket
    (array([...]), array([1, 1, 1, 1]))

Ticket ``i`` of ``B`` prompts takes the global positions ``i*B .. i*B + B - 1`` of an endless
stream; position ``q`` is row ``perm(seed, e)[p]`` of epoch ``e = q // N`` at place ``p = q % N``,
where ``perm(seed, e)`` is a seeded shuffle of the ``N`` rows drawn afresh each epoch. Nothing
else goes in: a replayed ticket (same index) gets the same rows in any process, and a run killed
and resumed (``--resume``), whose tickets continue from the checkpointed index, sees every row
exactly once per epoch. Keep this the ONE place that maps tickets to rows: when the ticket grows an
explicit data offset (a run resumed with another batch size), only :func:`ticket_start` changes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np


def ticket_start(ticket: Any) -> int:
    """Global stream position of a ticket's first prompt (an explicit `offset` wins if the ticket has one)."""
    offset = getattr(ticket, "offset", None)
    return int(offset) if offset is not None else int(ticket.index) * int(ticket.size)


@lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, n_rows: int, shuffle: bool = True) -> np.ndarray:
    """Row ids ``[n_rows]`` in the order epoch ``epoch`` visits them (a permutation)."""
    if not shuffle:
        return np.arange(n_rows, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, seed >> 32, epoch]))
    order = rng.permutation(n_rows).astype(np.int64)
    order.setflags(write=False)
    return order


def rows_for(seed: int, start: int, count: int, n_rows: int, shuffle: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[count]`` at stream positions ``start .. start + count - 1`` and their epochs ``[count]``."""
    if n_rows < 1:
        raise ValueError("the dataset has no rows; check its path and split")
    if start < 0 or count < 0:
        raise ValueError(f"stream positions must be >= 0, got start={start}, count={count}")
    pos = np.arange(start, start + count, dtype=np.int64)
    epochs, places = pos // n_rows, pos % n_rows
    rows = np.empty(count, dtype=np.int64)
    for e in np.unique(epochs):
        sel = epochs == e
        rows[sel] = epoch_order(seed, int(e), n_rows, shuffle)[places[sel]]
    return rows, epochs


def rows_for_ticket(seed: int, index: int, size: int, n_rows: int, shuffle: bool = True):
    """:func:`rows_for` of ticket ``index`` with ``size`` prompts (no explicit offset)."""
    return rows_for(seed, index * size, size, n_rows, shuffle)
