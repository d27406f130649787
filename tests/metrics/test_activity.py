"""Activity.shares: each span's share of a trailing window, from running totals, as a walk gives it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.metrics.activity import Activity, _walk

SPANS = ("compute", "wait_input", "weight_sync")


def test_a_snapshot_straddling_the_window_start_counts_pro_rata_and_the_rest_whole():
    act = Activity()
    act.add(0.0, 4.0, {"compute": 4.0})  # the window (last 5 s before 8.0) starts at 3.0: a quarter counts
    act.add(4.0, 6.0, {"compute": 1.0, "wait_input": 1.0})
    act.add(6.0, 8.0, {"wait_input": 2.0})
    got = act.shares(5.0)
    # covered: 1 + 2 + 2 = 5 s; compute 1.0 + 1.0, wait_input 1.0 + 2.0
    assert got == pytest.approx({"compute": 2.0 / 5, "wait_input": 3.0 / 5})
    assert act.shares(100.0) == pytest.approx({"compute": 5.0 / 8, "wait_input": 3.0 / 8})


def test_forgotten_entries_leave_the_window_and_an_empty_activity_has_no_shares():
    act = Activity()
    assert act.shares(5.0) is None and not act
    act.add(0.0, 1.0, {"compute": 1.0})
    act.add(1.0, 2.0, {"wait_input": 1.0})
    act.forget_before(1.5)
    assert len(act) == 1 and act.shares(100.0) == pytest.approx({"wait_input": 1.0})
    act.add(2.0, 2.0, {"compute": 0.0})  # a snapshot covering no time counts nothing
    assert act.shares(100.0) == pytest.approx({"wait_input": 1.0, "compute": 0.0})


def entries(ordered: bool):
    gap = st.floats(0.0, 0.7, allow_nan=False)
    spans = st.dictionaries(st.sampled_from(SPANS), st.floats(0.0, 0.5, allow_nan=False), max_size=3)
    step = st.tuples(gap, gap, spans, st.booleans())
    return st.lists(step, min_size=1, max_size=60).map(lambda steps: _timeline(steps, ordered))


def _timeline(steps, ordered: bool):
    out, t = [], 100.0
    for lag, dur, spans, back in steps:
        since = t - (lag if not ordered and back else 0.0)  # out of order: `since` before the last end
        t = since + dur if ordered or not back else t - lag
        out.append((min(since, t), t, spans))
    return out


@settings(max_examples=300, deadline=None)
@given(entries(ordered=True), st.floats(0.05, 12.0), st.floats(0.0, 20.0))
def test_running_totals_give_what_walking_the_window_gives(timeline, window, forget_lag):
    act = Activity()
    for since, t, spans in timeline:
        act.add(since, t, spans)
        act.forget_before(t - forget_lag - window)
    assert act.in_order
    want, got = _walk(act.entries, window), act.shares(window)
    assert (want is None) == (got is None)
    if want is not None:
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(entries(ordered=False), st.floats(0.05, 12.0))
def test_snapshots_out_of_order_fall_back_to_the_walk(timeline, window):
    act = Activity()
    for since, t, spans in timeline:
        act.add(since, t, spans)
    got = act.shares(window)
    if not act.in_order:
        assert got == _walk(act.entries, window)
