"""A synchronous step's critical path from a trace: which calls it chains, and what lies between."""

from __future__ import annotations

import pytest

from flowrl.metrics.steppath import step_path, step_path_table

NODES = ("prompts", "rollout", "reward", "reference", "actor")


def _trace(steps: int = 10, overlap: bool = False, publisher: bool = True, slow: frozenset = frozenset()) -> list[dict]:
    """prompts -> rollout -> {reward, reference} -> actor, weights actor -> rollout. Times in ms: a
    45 ms step, or (overlap) a rollout that starts the next batch while the actor trains; the round
    of each step in `slow` takes 10 ms longer (and so does that step)."""
    ev = [{"ph": "M", "name": "process_name", "pid": i + 1, "tid": 0, "ts": 0, "args": {"name": f"{n}/0"}}
          for i, n in enumerate(NODES)]
    pid = {n: i + 1 for i, n in enumerate(NODES)}

    def span(node, name, start, end, **args):
        ev.append({"ph": "X", "name": name, "pid": pid[node], "tid": 7, "ts": start * 1e3,
                   "dur": (end - start) * 1e3, "args": args})

    step = 25 if overlap else 45
    late = 0.0
    for t in range(steps):
        at, bid = 1000 + step * t + late, f"t-{t:06d}"
        extra = 10.0 if t in slow else 0.0
        late += extra
        span("prompts", "compute", at - 5, at - 4.5, batch_id=bid)  # a source: off the path
        span("rollout", "compute", at, at + 20, batch_id=bid)
        span("reference", "compute", at + 20.5, at + 22, batch_id=bid)  # a parallel branch, done first
        span("reward", "compute", at + 21, at + 23, batch_id=bid)
        span("actor", "compute", at + 24, at + 40, batch_id=bid)
        if publisher:  # the first snapshot is slow (it allocates; its round forms the group)
            span("actor", "weight_snapshot", at + 40.5, at + (40.9 if t == 0 else 40.6))
            span("actor", "weight_sync", at + 41, at + 44 + extra, version=t + 1)
        span("rollout", "weight_sync", at + 41.1, at + 44.1 + extra, version=t + 1, beside=True)
    return ev


def test_the_path_chains_the_calls_that_gated_each_other_and_the_sync_after_them():
    path = step_path(_trace())
    # steps 1..8 (each to the next one's call); step 0, the warm-up, is left out of every mean
    assert path is not None and path.steps == 8 and path.step_ms == pytest.approx(45)
    got = {label: (kind, round(ms, 3)) for label, kind, ms in path.parts}
    assert [label for label, _, _ in path.parts] == [
        "rollout call", "rollout -> reward", "reward call", "reward -> actor", "actor call",
        "actor call -> snapshot", "weight snapshot", "snapshot -> round (published, sync orders)",
        "weight-sync round", "round -> next rollout call (landing)"]
    assert got["rollout call"] == ("call", 20) and got["reward call"] == ("call", 2) and got["actor call"] == ("call", 16)
    assert got["rollout -> reward"] == ("between", 1)  # reward ended after reference: it gated the actor
    assert got["reward -> actor"] == ("between", 1)
    assert got["snapshot -> round (published, sync orders)"] == ("between", 0.4)
    # the round ends with the subscriber's receive (its span ends 0.1 ms after the publisher's)
    assert got["weight-sync round"] == ("between", 3.1) and got["round -> next rollout call (landing)"] == ("between", 0.9)
    assert path.ms("call") == pytest.approx(38) and path.ms("call") + path.ms("between") == pytest.approx(45)
    lines = step_path_table(path)
    assert lines[0].startswith("a synchronous step's critical path") and "45.0 ms a step" in lines[0]
    assert any("weight-sync round" in line and "3.10 ms" in line and "6.9%" in line for line in lines)
    assert lines[-1] == "  calls 38.0 ms (84.4%), between calls (the framework's) 7.0 ms (15.6%)"


def test_a_round_slow_now_and_then_shows_in_its_p90_not_its_median():
    path = step_path(_trace(steps=21, slow=frozenset({5, 10, 15})))  # 3 of the 19 steps measured
    assert path.steps == 19 and path.step_ms == pytest.approx(45 + 30 / 19)
    rounds = dict(zip([label for label, _, _ in path.parts], path.spread))["weight-sync round"]
    assert rounds[0] == pytest.approx(3.1) and rounds[1] == pytest.approx(13.1)  # median, p90
    calls = dict(zip([label for label, _, _ in path.parts], path.spread))["actor call"]
    assert calls == (pytest.approx(16), pytest.approx(16))
    line = next(line for line in step_path_table(path) if "weight-sync round" in line)
    assert line.endswith("median    3.10  p90   13.10"), line


def test_no_path_when_the_rollout_does_not_wait_for_the_round_or_nothing_publishes():
    assert step_path(_trace(overlap=True)) is None  # max_staleness >= 1: generation overlaps training
    assert step_path(_trace(publisher=False)) is None
    assert step_path([]) is None
