"""Removed replicas (flowrl/runtime/controller/scaling.py): `Retirement` forgets them once gone,
stops one that outstays its grace by PID, and a replica added again displaces its predecessor;
`scale` refuses what it cannot do before it changes anything. Fake processes and handles."""

import signal

import anyio
import pytest

from flowrl.graph import load_graph
from flowrl.graph.spec import WeightSyncSpec
from flowrl.runtime.controller.report import RunReport
from flowrl.runtime.controller.procs import Removal
from flowrl.runtime.controller.roles import Roles
from flowrl.runtime.controller.scaling import Retirement, ScaleError, scale
from flowrl.runtime.controller.weightorders import SyncGroup
from tests.runtime.controller_fakes import Failures, Outbox, ledger, table


class Handle:
    def __init__(self):
        self.code, self.signals = None, []

    def poll(self):
        return self.code

    def signal(self, sig):
        self.signals.append(sig)


def parts(tmp_path):
    procs = table("actor/0/0", "rollout/0/0", "rollout/1/0")
    sync = SyncGroup(procs, Roles(publishers=("actor",), subscribers=("rollout",)), send=Outbox(), fail=Failures(),
                     ledger=ledger(tmp_path), section=WeightSyncSpec(min_timeout_s=30.0), deadline_s=1.0)
    anyio.run(lambda: sync.form(0))
    return procs, sync, Retirement(procs, sync, RunReport(None, tmp_path), stop_timeout_s=5.0)


def test_a_removed_replica_is_forgotten_once_gone_and_stopped_by_pid_if_it_outstays_its_grace(tmp_path):
    procs, sync, ret = parts(tmp_path)
    gone = procs.get("rollout/1/0")
    gone.handle = Handle()
    anyio.run(ret.retire, gone, Outbox())
    assert ret.grace_s() == 35.0, "its sync timeout, then its stop timeout"
    t0 = gone.removed.at
    ret.reap(now=t0 + 35.0)
    assert gone.handle.signals == [] and "rollout/1/0" in procs.procs
    ret.reap(now=t0 + 36.0)
    ret.reap(now=t0 + 37.0)
    assert gone.handle.signals == [signal.SIGTERM], "once"
    ret.reap(now=t0 + 41.0)
    assert gone.handle.signals == [signal.SIGTERM, signal.SIGKILL]
    gone.handle.code = -9
    ret.reap(now=t0 + 42.0)
    assert "rollout/1/0" not in procs.procs and gone not in sync.members


def test_a_replica_added_again_displaces_its_predecessor_which_is_reaped_apart(tmp_path):
    procs, sync, ret = parts(tmp_path)
    old = procs.get("rollout/1/0")
    old.handle = Handle()
    old.removed = Removal()
    ret.displace(old)
    assert old.handle.signals == [signal.SIGKILL] and "rollout/1/0" not in procs.procs and old not in sync.members
    assert ret.retiring == [old]
    old.handle.code = -9
    ret.reap()
    assert ret.retiring == []


@pytest.mark.parametrize("node, replicas, recovering, why", [
    ("nope", 2, False, "no node 'nope'; nodes are numbers, scale, collect"),
    ("collect", 2, False, "node 'collect' is stateful"),
    ("scale", 0, False, "replicas must be between 1 and 256, got 0"),
    ("scale", 2, True, "the run is recovering from a failure; try again in a moment"),
])
def test_scale_refuses_before_it_changes_anything(tmp_path, node, replicas, recovering, why):
    path = tmp_path / "g.yaml"
    path.write_text("""\
nodes:
  numbers: {kind: "flowrl.testing.nodes:Numbers"}
  scale: {kind: "flowrl.testing.nodes:Scale"}
  collect: {kind: "flowrl.testing.nodes:Collect"}
edges: [numbers -> scale, scale -> collect]
""")
    spec = load_graph(path)
    roles = Roles(sources=("numbers",), sinks=("collect",), stateful=("collect",))
    wiring = type("Wiring", (), {"multi_host": False})()
    with pytest.raises(ScaleError) as e:
        anyio.run(lambda: scale(node, replicas, spec=spec, roles=roles, procs=table(), wiring=wiring, launch=None,
                                send=Outbox(), sync=None, retirement=None, report=None, ledger=None,
                                recovering=recovering, version=0))
    assert str(e.value).startswith(why)
    assert spec.nodes["scale"].replicas == 1
