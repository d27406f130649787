"""benchmarks/relay.py: the same chain as a flowrl run and as raw pyzmq processes, CPU per batch of each."""

from __future__ import annotations

import pytest

from tests.benchmark_modules import benchmark


@pytest.fixture(scope="module")
def relay():
    return benchmark("relay")


@pytest.mark.timeout(120)
def test_both_chains_run_and_each_role_reports_its_cpu_per_batch(relay, tmp_path):
    # a second of steps: the runtime samples its threads' CPU every 0.2 s at most
    steps, period = 30, 0.03
    flowrl = relay.flowrl_row(tmp_path, steps=steps, relays=2, period=period)
    raw = relay.raw_row(steps=steps, relays=2, period=period)
    for row in (flowrl, raw):
        assert set(row) >= {"source", "relay", "sink", "controller"}
        assert all(row[k] > 0 for k in ("source", "relay", "sink", "controller")), row
    # the run's own accounting covered every step's row, the sink holding each batch for its period
    assert flowrl["step_ms"] >= period * 1e3
    assert not list(tmp_path.glob("relay/logs/*.dump")), "a node of the flowrl chain wrote a dump"
