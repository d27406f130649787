"""TurnBook (controller/turns.py) without processes: one awake member per group, grants in the
scheduler's order, a dead holder holds nothing; and Offload: tensors back bitwise after a sleep."""

from types import SimpleNamespace

import torch

from flowrl.rl.offload import Offload, trainer_tensors
from flowrl.runtime.controller.turns import TurnBook, turn_groups

A, R, C = "actor/0/0", "rollout/0/0", "critic/0/0"


def book_of(*members) -> TurnBook:
    book = TurnBook({p.split("/")[0]: "g" for p in members})
    for p in members:
        assert book.ready(p) == []
    return book


def test_a_member_is_granted_only_once_every_other_member_released():
    book = book_of(A, R)
    assert book.ask(R, 0) == [("yield", A, 0)]  # both awake after setup: the actor yields first
    assert book.ask(R, 0) == []  # a yield is asked once
    assert book.released(R, 0) == []  # the asker's own release of turn 0 changes nothing it waits for
    assert book.released(A, 0) == [("grant", R, 1)]
    assert book.ask(A, 0) == [("yield", R, 1)]
    assert book.released(R, 0) == []  # an older turn's release changes nothing
    assert book.released(R, 1) == [("grant", A, 2)]
    assert book.holder("g") == [A]


def test_waiters_are_granted_in_ticket_order_and_a_dead_holder_holds_nothing():
    book = book_of(A, R, C)
    for p in (A, R, C):
        book.released(p, 0)
    assert book.ask(A, 5) == [("grant", A, 1)]
    assert book.ask(C, 4) == [("yield", A, 1)]
    assert book.ask(R, 3) == []
    assert book.down(A) == [("grant", R, 2)]  # killed while holding: the lowest ticket goes next
    # restarted, it is awake (its setup used the memory) until it releases: both are asked to yield
    assert book.ready(A) == [("yield", R, 2), ("yield", A, 0)]
    assert book.released(R, 2) == [] and book.released(A, 0) == [("grant", C, 3)]


def test_only_colocation_groups_that_take_turns_are_groups():
    node = lambda colocate=(), turns=False: SimpleNamespace(colocate_with=list(colocate), take_turns=turns)
    spec = SimpleNamespace(nodes={"actor": node(), "rollout": node(["actor"], True), "ref": node(["reward"]),
                                  "reward": node()})
    assert turn_groups(spec) == {"actor": "actor+rollout", "rollout": "actor+rollout"}


def test_offloaded_trainer_state_comes_back_bitwise_and_views_see_it(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    alias = model.state_dict()  # what a weight subscriber writes into
    before = {k: v.clone() for k, v in trainer_tensors(model, opt).items()}
    off = Offload(tmp_path / "t.pt")
    assert off.put(trainer_tensors(model, opt)) > 0
    assert all(t.untyped_storage().nbytes() == 0 for t in trainer_tensors(model, opt).values())
    off.take()
    after = trainer_tensors(model, opt)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(alias["0.weight"], model[0].weight) and not (tmp_path / "t.pt").exists()
    opt.step()  # the optimizer goes on with the same state objects
