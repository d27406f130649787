"""The live view: plain log lines off a terminal, a rich panel on one."""

from __future__ import annotations

import io
import re

from flowrl.metrics import LiveView, MetricsHub, Recorder

GRAPH = {"name": "ppo", "nodes": {"rollout": 2, "reward": 1, "actor": 1},
         "edges": ["rollout->reward", "reward->actor"], "total_steps": 10}


def _step(hub, clock, step, recs={}):  # noqa: B006 - one set of node recorders per hub
    mine = recs.setdefault(id(hub), {(n, r): Recorder(n, r, clock=clock)
                                     for n, r in (("rollout", 0), ("rollout", 1), ("actor", 0))})
    for replica in (0, 1):
        rec = mine[("rollout", replica)]
        rec.add_span("compute", clock.t, 0.9)
        rec.count("tokens", 1000)
    actor = mine[("actor", 0)]
    actor.add_span("wait_input", clock.t, 0.6)
    actor.add_span("wait_credit", clock.t + 0.6, 0.3)
    actor.mean("reward", 0.25 * step)
    actor.max("staleness", 1)
    clock.t += 1.0
    for rec in mine.values():
        hub.ingest(rec.drain())
    hub.set("queue_depth", step, edge="rollout->reward")
    hub.inc("restarts", node="reward")
    hub.end_step(step=step, policy_version=step)


class Ticker:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_plain_view_prints_one_readable_line_per_interval_and_a_final_line(tmp_path, clock):
    out, ticks = io.StringIO(), Ticker()
    with MetricsHub(tmp_path, devices=2, clock=clock) as hub:
        with LiveView(hub, GRAPH, stream=out, interval_s=10, clock=ticks) as view:
            assert view.plain  # StringIO is not a TTY
            view.update()  # first call prints
            _step(hub, clock, 1)
            ticks.t = 5
            view.update()  # too soon: nothing
            _step(hub, clock, 2)
            ticks.t = 10
            view.update()
            _step(hub, clock, 3)
        with LiveView(hub, GRAPH, stream=out, interval_s=10, clock=ticks) as view:
            view.update()  # the final line on exit would repeat this one: not printed
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # start, one after 10 s, final on exit; then the second view's one
    assert lines[0].startswith("[flowrl] step -/10")
    assert lines[1].startswith("[flowrl] step 2/10 v2")
    assert lines[2] == lines[3]
    last = lines[2]
    assert last.startswith("[flowrl] step 3/10 v3")
    for part in ("reward 0.750", "2.0k tok/s (1.0k/dev)", "staleness<=1",
                 "busy rollout x2 90% actor 0% (blocked 30%) | starting reward",
                 "q rollout->reward=3", "restarts 3 (reward 3)"):
        assert part in last, (part, last)
    assert len(last) < 200, last


def test_rich_view_draws_nodes_edges_and_throughput_on_a_terminal(tmp_path, clock):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    with MetricsHub(tmp_path, clock=clock) as hub:
        with LiveView(hub, GRAPH, stream=out) as view:
            assert not view.plain
            _step(hub, clock, 1)
            view.update(force=True)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # drop colours and cursor moves
    for part in ("flowrl · ppo", "step 1/10", "rollout", "2/2", "reward", "0/1", "starting",
                 "actor", "rollout->reward", "tok/s", "starved"):
        assert part in text, part


def test_status_dir_keeps_status_json_fresh_between_steps(tmp_path, clock):
    from flowrl.metrics import read_status

    ticks = Ticker()
    with MetricsHub(tmp_path, clock=clock) as hub:
        view = LiveView(hub, GRAPH, stream=io.StringIO(), clock=ticks, status_dir=tmp_path)
        with view:
            view.update()
            assert read_status(tmp_path)["phase"] == "starting"  # before the first step
            _step(hub, clock, 1)
            ticks.t = 0.5
            view.update()  # younger than status_interval_s: not rewritten
            assert read_status(tmp_path)["step"] is None
            ticks.t = 1.0
            view.update()
            doc = read_status(tmp_path)
    assert doc["phase"] == "running" and doc["step"] == 1 and doc["graph"]["total_steps"] == 10
