"""The ticket -> rows mapping: pure, exactly once per epoch, the same for a replayed ticket."""

import numpy as np
import pytest

from flowrl.data import rows_for, rows_for_ticket, ticket_start
from flowrl.runtime.node import Ticket


@pytest.mark.parametrize("batch", [1, 3, 7, 10, 16])
def test_every_row_comes_exactly_once_per_epoch_whatever_the_batch_size(batch):
    n, epochs = 10, 3
    tickets = -(-n * epochs // batch)
    rows, eps = zip(*(rows_for_ticket(5, i, batch, n) for i in range(tickets)))
    rows, eps = np.concatenate(rows)[: n * epochs], np.concatenate(eps)[: n * epochs]
    for e in range(epochs):
        assert sorted(rows[eps == e].tolist()) == list(range(n))


def test_a_replayed_ticket_gets_the_same_rows_and_epochs_reshuffle():
    a, _ = rows_for_ticket(0, 4, 5, 20)
    b, _ = rows_for_ticket(0, 4, 5, 20)
    assert a.tolist() == b.tolist()
    first, second = rows_for(0, 0, 20, 20)[0], rows_for(0, 20, 20, 20)[0]
    assert first.tolist() != second.tolist()  # a fresh shuffle each epoch
    assert rows_for(1, 0, 20, 20)[0].tolist() != first.tolist()  # and per seed
    assert rows_for(0, 0, 20, 20, shuffle=False)[0].tolist() == list(range(20))


def test_the_stream_position_is_the_ticket_index_times_its_size_unless_the_ticket_carries_an_offset():
    t = Ticket(batch_id="t-000003", index=3, attempt=0, min_policy_version=0, size=8)
    assert ticket_start(t) == 24
    t.offset = 5  # what an explicit data offset on the ticket would say
    assert ticket_start(t) == 5


def test_an_empty_dataset_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="no rows"):
        rows_for(0, 0, 4, 0)
