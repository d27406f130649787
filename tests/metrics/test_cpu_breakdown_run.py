"""Where the cycles go, in a real run: `flowrl run graphs/grpo.yaml` (12 steps, stack sampler on),
then `flowrl report`'s CPU-per-step table and report/cpu.json: every process is there, the numbers
add up, and the accounting covers the process's own CPU total.

About 30 s on two shared cores; the run's process group is killed in `finally` (run_graph)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.metrics.report import make_report
from flowrl.metrics.stacks import CATEGORIES
from flowrl.testing.harness import run_graph

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

ROOT = Path(__file__).resolve().parents[2]
NODES = ("rollout", "actor")  # every other node runs inside the rollout's process (fuse_into)


def test_a_real_runs_report_breaks_each_processs_cpu_into_compute_framework_and_idle(tmp_path):
    run = run_graph(ROOT / "graphs" / "grpo.yaml", tmp_path / "run", overrides=["schedule.steps=12"],
                    timeout_s=150, cwd=ROOT, env={"FLOWRL_CPU_SAMPLER": "1"})
    assert run.exit_code == 0, run.stderr[-3000:]
    make_report(run.run_dir)
    b = json.loads((run.run_dir / "report" / "cpu.json").read_text())
    assert set(b["nodes"]) == {*NODES, "controller"}
    summary = (run.run_dir / "report" / "summary.txt").read_text()
    assert "rollout also runs prompts, reward, reference, advantages (fuse_into): their CPU is rollout's" in summary
    assert b["steps"] == 11 and b["sampled"]
    for name, n in b["nodes"].items():
        assert n["framework_ms"] > 0, name
        assert sum(n["categories_ms"].values()) == pytest.approx(n["framework_ms"], rel=1e-6), name
        assert n["cpu_ms"] == pytest.approx(n["compute_ms"] + n["framework_ms"], rel=1e-6), name
        # compute + framework + idle = wall, unless threads ran side by side for more CPU than wall
        if n["cpu_ms"] <= n["wall_ms"]:
            assert n["compute_ms"] + n["framework_ms"] + n["idle_ms"] == pytest.approx(n["wall_ms"], rel=1e-6)
        # the per-thread sums cover the process's own CPU total (CLOCK_PROCESS_CPUTIME_ID) over the
        # rows up to the node's last CPU read (compute spans ride on every ticket, thread reads on a
        # timer: counting spans past the last read once gave the actor 2.2x its process total)
        assert n["cpu_ms"] == pytest.approx(n["process_cpu_ms"], rel=0.25, abs=2.0), name
    actor = b["nodes"]["actor"]
    assert actor["compute_ms"] > actor["framework_ms"] > 0  # the trainer trains
    assert actor["threads_ms"]["compute_in_span"] > 0
    assert b["nodes"]["controller"]["compute_ms"] == 0  # the controller runs no model
    assert set(b["total"]["categories_ms"]) == set(CATEGORIES)
    assert 0 < b["total"]["framework_pct"] < 100
    summary = (run.run_dir / "report" / "summary.txt").read_text()
    assert "CPU per step, steps 2..12" in summary and "framework share of all CPU" in summary
    trace = (run.run_dir / "trace.json").read_text()
    assert '"cpu_ms"' in trace  # each compute span carries its CPU
