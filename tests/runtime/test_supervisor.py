"""The supervisor's verdicts at given instants: when a live process counts as hung (no processes,
no clock; tests/fault/test_chaos.py sees the same verdicts in real runs)."""

from types import SimpleNamespace

from flowrl.runtime.controller.supervisor import Supervisor

SUPERVISION = SimpleNamespace(deadline_s=4.0, startup_timeout_s=60.0, process_timeout_s=30.0)


def proc(**state):
    running = SimpleNamespace(poll=lambda: None)
    return SimpleNamespace(**{"restart": SimpleNamespace(at=None), "down_since": None, "handle": running, "ready": True,
                              "error": None, "started_at": 0.0, "last_seen": 100.0, "busy": None, **state})


def test_a_ready_process_is_hung_once_its_last_heartbeat_is_older_than_the_deadline(tmp_path):
    sup = Supervisor(None, tmp_path, SUPERVISION, {})
    p = proc()
    assert sup.check([p], now=100.0 + 4.0) == []  # at the deadline: not yet
    ((down, why),) = sup.check([p], now=100.0 + 4.5)
    assert down is p and why == "missed heartbeats for 4.5 s (deadline 4.0 s): hung"


def test_a_process_inside_one_call_past_process_timeout_is_hung_though_it_beats(tmp_path):
    sup = Supervisor(None, tmp_path, SUPERVISION, {})
    assert sup.check([proc(last_seen=110.0, busy=("process", 30.0))], now=110.0) == []
    ((_, why),) = sup.check([proc(last_seen=110.0, busy=("process", 31.0))], now=110.0)
    assert why == "spent 31.0 s inside one call on process (process_timeout_s 30.0): hung"


def test_a_process_not_ready_yet_is_judged_by_the_startup_timeout_not_the_deadline(tmp_path):
    sup = Supervisor(None, tmp_path, SUPERVISION, {})
    p = proc(ready=False, last_seen=0.0)
    assert sup.check([p], now=59.0) == []
    ((_, why),) = sup.check([p], now=61.0)
    assert why == "did not report READY within 60 s"
