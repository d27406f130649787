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
    # killed while holding: the lowest ticket goes next, told to yield at once (the critic still waits)
    assert book.down(A) == [("grant", R, 2), ("yield", R, 2)]
    # restarted, it is awake (its setup used the memory) until it releases: asked to yield
    assert book.ready(A) == [("yield", A, 0)]
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


def test_a_yield_that_comes_with_the_grant_is_kept_for_the_turn_being_taken_not_answered_at_once():
    """The controller grants a turn and, others waiting, asks it back at once (TurnBook._next): the
    yield can reach the worker before its asking task woke. It must release after the call it
    asked for, not say 'released' before it even began (two members awake: a real overlap)."""
    import contextlib

    import anyio

    from flowrl.runtime.protocol import messages as m
    from flowrl.runtime.worker.turns import TurnClient

    class Rec:
        def span(self, *a, **k):
            return contextlib.nullcontext()

        def max(self, *a, **k): ...
        def count(self, *a, **k): ...
        def observe(self, *a, **k): ...

    said: list = []
    node = SimpleNamespace(sleep=lambda: None, wake=lambda: None)

    async def main():
        async def report(msg):
            said.append(msg)
            if isinstance(msg, m.TurnAsk):  # the grant and the yield arrive back to back
                client.arrived(m.TurnGrant(turn=4))
                client.arrived(m.TurnYield(turn=4))

        async def run(fn, *args):
            return fn(*args)

        client = TurnClient("g", proc_id=A, timeout_s=5, run=run, node=lambda: node, report=report, recorder=Rec())
        client.held, client.asleep = False, True  # slept after turn 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.serve)
            await anyio.sleep(0)
            said.clear()
            async with client.use("t-000002"):
                assert client.held and client.turn == 4
                assert not any(isinstance(x, m.TurnReleased) for x in said), said  # not while it computes
            with anyio.fail_after(5):
                while not any(isinstance(x, m.TurnReleased) for x in said):
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert [type(x).__name__ for x in said] == ["TurnAsk", "TurnReleased"] and said[1].turn == 4

    anyio.run(main)
