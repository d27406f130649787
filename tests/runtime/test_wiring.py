"""Wiring on its own (flowrl/runtime/controller/wiring.py): what each process is told, where a
(re)started one begins, the addresses consumers bound and when producers are wired. A real graph,
plan and address book; fake processes' sends. The graph's tuning reaches each process spec."""

import anyio
import pytest

from flowrl.graph import load_graph, node_classes
from flowrl.placement import get_inventory, make_plan
from flowrl.runtime.controller.procs import ProcTable
from flowrl.runtime.controller.recovery import RecoveryBook
from flowrl.runtime.controller.roles import Roles
from flowrl.runtime.controller.scheduler import Scheduler
from flowrl.runtime.controller.wiring import RunFacts, Wiring
from flowrl.runtime.protocol import messages as m
from flowrl.runtime.protocol.addresses import Network
from tests.runtime.controller_fakes import Outbox, ledger

N = "flowrl.testing.nodes"


class Launcher:
    def host_address(self, host):
        return "127.0.0.1"

    def free_port(self, address):
        from flowrl.runtime.protocol.addresses import free_port

        return free_port(address)


@pytest.fixture
def wiring(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(f"""\
nodes:
  numbers: {{kind: "{N}:Numbers"}}
  scale: {{kind: "{N}:Scale", replicas: 2}}
  collect: {{kind: "{N}:Collect"}}
edges: [numbers -> scale, scale -> collect]
supervision: {{heartbeat_s: 0.25, peer_timeout_s: 42}}
""")
    spec = load_graph(path)  # checked: every edge names its ports
    classes = node_classes(spec)
    plan = make_plan(spec, get_inventory(None), classes)
    net = Network(spec, classes, tmp_path / "socks", "127.0.0.1")
    for e in plan.entries:
        net.place(f"{e.node}/{e.replica}/{e.rank}", "127.0.0.1")
    roles = Roles.of(spec, classes)
    led = ledger(tmp_path)
    book = RecoveryBook(tmp_path, ["collect/0/0"], keep=2, ledger=led)
    sched = Scheduler(steps=5, batch_size=1, max_staleness=0, sinks=list(roles.sinks), stateful_sinks=roles.stateful_sinks,
                      ticket_timeout_s=10, ledger=led, epoch=lambda: book.epoch)
    out = Outbox()
    w = Wiring(spec, plan, classes, roles, net, RunFacts(tmp_path, "s3cret", ("kill:scale/0@3",)), launcher=Launcher(),
               procs=ProcTable(), send=out, book=book, scheduler=sched)
    w.build_procs()
    return w, out


def test_each_process_is_told_its_routes_roles_secret_faults_and_the_graphs_timeouts(wiring):
    w, _ = wiring
    assert sorted(p.id for p in w.procs) == ["collect/0/0", "numbers/0/0", "scale/0/0", "scale/1/0"]
    numbers = w.procs.get("numbers/0/0").spec
    assert numbers.is_source and not numbers.is_sink
    assert [len(r.addresses) for r in numbers.outputs] == [2], "one address per consumer replica"
    for p in w.procs:
        assert (p.spec.secret, p.spec.faults) == ("s3cret", ["kill:scale/0@3"])
        assert (p.spec.heartbeat_s, p.spec.peer_timeout_s) == (0.25, 42.0)
    assert w.procs.get("collect/0/0").spec.is_sink


def test_no_wire_goes_out_until_every_process_is_ready_then_a_late_one_is_wired_at_once(wiring):
    w, out = wiring
    procs = list(w.procs)
    for p in procs[:-1]:
        p.ready = True
        anyio.run(w.after_ready, p)
    assert out.sent == []
    procs[-1].ready = True
    anyio.run(w.after_ready, procs[-1])
    assert sorted(who for who, _ in out.of(m.Wire)) == sorted(p.id for p in procs)
    out.clear()
    anyio.run(w.after_ready, procs[0])  # restarted later
    assert [who for who, _ in out.of(m.Wire)] == [procs[0].id]


def test_a_consumer_that_binds_elsewhere_is_reached_there_by_every_ready_producer(wiring):
    w, out = wiring
    scale0 = w.procs.get("scale/0/0")
    first = scale0.spec.inputs["in"]
    anyio.run(w.on_bound, scale0, {"in": first, "nope": "ipc://x"})
    assert out.sent == [] and w.address("scale", 0, "in") == first, "the first report: nobody to tell"
    w.procs.get("numbers/0/0").ready = True
    anyio.run(w.on_bound, scale0, {"in": "ipc://elsewhere"})
    assert [(who, type(msg).__name__, msg.address) for who, msg in out.sent] == [
        ("numbers/0/0", "Connect", "ipc://elsewhere"), ("numbers/0/0", "Disconnect", first)]
    assert w.address("scale", 0, "in") == "ipc://elsewhere" == scale0.spec.inputs["in"]
    (routes,) = w.routes_for(w.procs.get("numbers/0/0")).values()
    assert [address for address, _ in routes] == ["ipc://elsewhere", w.address("scale", 1, "in")]


def test_a_restarted_process_begins_in_the_books_epoch_from_its_committed_state(wiring, tmp_path):
    w, _ = wiring
    (tmp_path / "checkpoints" / "step00000002").mkdir(parents=True)
    w.book.report("collect/0/0", step=2, epoch=0, file="step00000002/collect.0.0.e0.pt", version=2)
    w.book.commit(2, {})
    w.book.begin_recovery()
    collect = w.procs.get("collect/0/0")
    w.prepare_start(collect)
    assert collect.spec.epoch == 1 and collect.spec.watermark == 2 and collect.spec.steps == 5
    assert collect.spec.resume_from.endswith("step00000002/collect.0.0.e0.pt")
    scale = w.procs.get("scale/0/0")
    w.prepare_start(scale)
    assert scale.spec.epoch == 1 and scale.spec.resume_from is None


def test_the_plan_grows_and_shrinks_as_scale_asks(wiring):
    w, _ = wiring
    entries, errors = w.plan_replicas("scale", 3)
    assert errors == [] and [(e.node, e.replica) for e in entries] == [("scale", 2)]
    w.add_entry(entries[0])
    w.drop_entries("scale", 1)
    assert sorted((e.node, e.replica) for e in w.plan.entries if e.node == "scale") == [("scale", 0)]
