"""The controller's own parts (flowrl/runtime/controller/controller.py, outcome.py): every message a
node sends has one handler; the first failure of a run is its failure; the tuning the controller's
components take is in the graph, with the values the runtime always used."""

from types import SimpleNamespace

from flowrl.graph.spec import GraphSpec
from flowrl.runtime.controller.controller import Controller
from flowrl.runtime.controller.outcome import Outcome
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.ledger import read_jsonl
from tests.runtime.controller_fakes import ledger


def test_every_message_a_node_sends_has_exactly_one_handler():
    from_nodes = {cls for cls in m._TYPES.values() if cls.direction == "node -> controller"}
    assert set(Controller.HANDLERS) == from_nodes
    assert all(callable(h) for h in Controller.HANDLERS.values())


def test_the_first_failure_is_the_runs_and_is_written_once(tmp_path):
    led = ledger(tmp_path)
    out = Outcome(SimpleNamespace(describe=lambda proc, why: f"{proc} {why}"), led)
    out.fail(None, "recovery epoch 1 did not complete\n  details")
    out.fail("actor/0/0", "exited")
    assert out.failure == "recovery epoch 1 did not complete\n  details"
    led.flush()
    assert [r["why"] for r in read_jsonl(led.path) if r["event"] == "failed"] == ["recovery epoch 1 did not complete"]


def test_the_controllers_tuning_is_in_the_graph_with_the_values_it_always_had():
    g = GraphSpec(nodes={"a": {"kind": "x"}})
    c = g.controller
    assert (c.tick_s, c.final_checkpoint_wait_s) == (0.05, 60.0)
    assert c.tickets.progress_interval_s == 0.25
    assert (c.weight_sync.max_failures, c.weight_sync.min_timeout_s, c.weight_sync.timeout_deadlines) == (5, 30.0, 4.0)
    assert c.recovery.epoch_resend_s == 2.0
    assert g.supervision.peer_timeout_s == 300.0


def test_a_commit_writes_the_rows_of_the_steps_it_counts_first(tmp_path, monkeypatch):
    """A controller killed right after a commit is resumed past that step and never makes its row
    again: the rows that waited in the report's backlog are on disk before the commit record."""
    import flowrl.runtime.controller.controller as controller
    from flowrl.metrics import MetricsHub
    from flowrl.runtime.controller.report import RunReport

    hub = MetricsHub(tmp_path)
    report = RunReport(hub, tmp_path)
    for step in (1, 2):
        report.step(step, version=step, staleness=0, done=False)
    assert report.backlog  # metrics work waits until the control socket is quiet

    def rows() -> list[int]:
        return [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")]

    seen = {}
    book = SimpleNamespace(committable=lambda below: 2, root=tmp_path / "checkpoints",
                           commit=lambda step, state: seen.setdefault(step, rows()))
    monkeypatch.setattr(controller, "prune_shards", lambda *a: None)
    fake = SimpleNamespace(book=book, report=report, restarts=SimpleNamespace(launcher=None),
                           scheduler=SimpleNamespace(complete_below=8, state_dict=lambda step: {}))
    Controller.commit_if_ready(fake)
    assert seen == {2: [1, 2]}
    hub.close()


def test_a_published_version_lets_its_tickets_out_before_the_sync_orders_go():
    """At max_staleness 0 the next batch's way (the ticket to the source, its batch to the rollout)
    takes longer than the weight-sync round, and a control send that follows another waits for the
    socket's I/O thread: the tickets go first. A version of an older recovery epoch moves nothing."""
    import anyio

    sent = []

    async def flush():
        sent.append("tickets")

    async def order(version, *, recovering):
        sent.append(("orders", version, recovering))

    me = SimpleNamespace(book=SimpleNamespace(epoch=2), recovery=SimpleNamespace(active=False),
                         scheduler=SimpleNamespace(set_version=lambda v: sent.append(("version", v))),
                         flush=flush, sync=SimpleNamespace(order=order))
    anyio.run(Controller.on_published, me, None, m.Published(version=5, epoch=2))
    assert sent == [("version", 5), "tickets", ("orders", 5, False)]
    sent.clear()
    anyio.run(Controller.on_published, me, None, m.Published(version=6, epoch=1))
    assert sent == []
