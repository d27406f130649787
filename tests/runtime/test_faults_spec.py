"""The fault spec language (flowrl/runtime/protocol/faults.py) and which faults a node process
takes on (flowrl/runtime/worker/faults.py): no processes, nothing fires a signal here."""

from __future__ import annotations

import pytest

from flowrl.runtime.protocol.faults import Fault, FaultSpecError, parse_faults
from flowrl.runtime.worker.faults import FaultInjector


def test_a_spec_names_its_action_target_trigger_and_options():
    f = Fault.parse("delay:rollout/1/2@t=2.5,seconds=0.1,every")
    assert (f.action, f.node, f.replica, f.rank, f.t, f.step, f.seconds, f.every) == \
        ("delay", "rollout", 1, 2, 2.5, None, 0.1, True)
    assert Fault.parse("kill:actor@checkpoint=10").checkpoint == 10
    assert Fault.parse("fail_sync:rollout@version=2").version == 2
    assert Fault.parse("crash:critic").step == 0  # no trigger: the first step


@pytest.mark.parametrize("text, says", [
    ("explode:rollout", "unknown action 'explode'"),
    ("kill:", "no node named"),
    ("kill:rollout/x", "replica and rank must be numbers"),
    ("kill:rollout@when=3", "bad trigger 'when=3'"),
    ("kill:rollout@step=three", "step must be a number"),
    ("slow:reward,seconds=a", "seconds must be a number"),
    ("slow:reward,loud", "unknown option 'loud'"),
])
def test_a_bad_spec_is_refused_naming_what_is_wrong_and_the_form_to_write(text, says):
    with pytest.raises(FaultSpecError) as e:
        parse_faults([text])
    assert says in str(e.value) and repr(text) in str(e.value)
    assert "ACTION:NODE" in str(e.value) or "must be a number" in str(e.value)


def test_a_process_takes_only_the_faults_that_target_its_node_replica_and_rank():
    specs = ["kill:actor@step=1", "kill:actor/1@step=2", "kill:actor/0/1@step=3", "drop:rollout@step=0"]
    assert [f.step for f in FaultInjector(specs, "actor", 0, 0).faults] == [1]
    assert [f.step for f in FaultInjector(specs, "actor", 1, 0).faults] == [1, 2]
    assert [f.step for f in FaultInjector(specs, "actor", 0, 1).faults] == [1, 3]
    assert FaultInjector(specs, "reward", 0, 0).faults == []


def test_a_restarted_process_runs_clean_unless_the_fault_says_every():
    specs = ["fail_sync:rollout@version=2", "fail_sync:rollout@version=3,every"]
    first, again = FaultInjector(specs, "rollout", 0), FaultInjector(specs, "rollout", 0)
    first.arm(incarnation=0)
    again.arm(incarnation=1)
    assert [f.version for f in first.faults] == [2, 3]
    assert [f.version for f in again.faults] == [3]


def test_a_fault_fires_once_at_its_trigger():
    inj = FaultInjector(["fail_sync:rollout@version=2", "stall:rollout@step=4,seconds=3"], "rollout", 0)
    inj.arm(0)
    assert [inj.fail_sync(v) for v in (1, 2, 2, 3)] == [False, True, False, False]
    assert [inj.stall(s) for s in (3, 4, 4)] == [0.0, 3.0, 0.0]


def test_a_crash_fault_fails_setup_naming_itself():
    with pytest.raises(RuntimeError, match="injected crash in setup"):
        FaultInjector(["crash:critic"], "critic", 0).check_setup()
    FaultInjector(["crash:critic"], "actor", 0).check_setup()  # not this node: nothing
