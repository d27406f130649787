"""Shared fixtures: synthetic run directories with a known bottleneck, and a virtual clock."""

from __future__ import annotations

import pytest

from flowrl.metrics.synthetic import VirtualClock, write_synthetic_run


@pytest.fixture(scope="session")
def synthetic_runs(tmp_path_factory):
    """{"rollout_bound": RUN_DIR, "actor_bound": RUN_DIR}, written once per session."""
    root = tmp_path_factory.mktemp("runs")
    return {sc: write_synthetic_run(root / sc, sc, steps=30) for sc in ("rollout_bound", "actor_bound")}


@pytest.fixture
def clock():
    return VirtualClock(1_700_000_000.0)
