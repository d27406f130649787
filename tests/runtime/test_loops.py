"""The event loop of the runtime's processes (flowrl/runtime/protocol/loops.py): uvloop where it
is installed, asyncio's own with FLOWRL_UVLOOP=0; a run is the same on either."""

from __future__ import annotations

import asyncio

import pytest

from flowrl.runtime.protocol import loops
from flowrl.testing import node_state, run_graph
from flowrl.testing.nodes import Collect

pytestmark = pytest.mark.timeout(120)

uvloop = pytest.importorskip("uvloop")


class LoopCollect(Collect):
    """Collect, whose state also says which loop its hooks ran on (the compute thread's)."""

    def state_dict(self):
        return {**super().state_dict(), "loop": type(asyncio.get_running_loop()).__module__}


GRAPH = """\
nodes:
  numbers: {kind: "flowrl.testing.nodes:Numbers"}
  collect: {kind: "tests.runtime.test_loops:LoopCollect"}
edges: [numbers -> collect]
schedule: {steps: 6, batch_size: 4, max_staleness: 1, checkpoint_every: 3}
supervision: {heartbeat_s: 0.2, deadline_s: 3.0}
"""


def test_run_options_and_new_loops_follow_the_environment(monkeypatch):
    monkeypatch.delenv(loops.ENV, raising=False)
    assert loops.run_options() == {"use_uvloop": True}
    loop = loops.new_event_loop()
    assert isinstance(loop, uvloop.Loop)
    loop.close()
    monkeypatch.setenv(loops.ENV, "0")
    assert loops.run_options() == {}
    loop = loops.new_event_loop()
    assert type(loop).__module__.startswith("asyncio") and not isinstance(loop, uvloop.Loop)
    loop.close()


@pytest.mark.parametrize("setting, loop", [(None, "uvloop"), ("0", "asyncio.unix_events")], ids=["uvloop", "asyncio"])
def test_a_run_is_the_same_on_either_loop(tmp_path, setting, loop):
    (tmp_path / "g.yaml").write_text(GRAPH)
    env = {} if setting is None else {loops.ENV: setting}
    result = run_graph(tmp_path / "g.yaml", tmp_path / "run", env=env, timeout_s=90)
    assert result.exit_code == 0, result.stderr[-3000:]
    audit = result.audit()
    assert audit.exactly_once and len(audit.issued) == 6, (audit.lost, audit.duplicated)
    state = node_state(result.run_dir, "collect", step=6)
    assert [bid for bid, _ in state["seen"]] == [f"t-{i:06d}" for i in range(6)]
    assert state["loop"] == loop
