"""benchmarks/hops.py runs every method to the end: each echo answers every round, and it leaves no process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_the_hop_benchmark_times_every_round_of_every_method_and_its_echoes_exit(tmp_path):
    out = tmp_path / "hops.json"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    proc = subprocess.run([sys.executable, "benchmarks/hops.py", "--rounds", "20", "--gaps", "0.002", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(out.read_text())
    assert [r["method"] for r in facts["rows"]] == ["pipe", "pyzmq ipc", "flowrl channel"]
    for r in facts["rows"]:
        assert r["rounds"] == 18 and 0 < r["rtt_median_us"] <= r["rtt_p90_us"]  # 20, less the first 2
    assert set(facts["cold_loop_us"]) == {"0.0", "0.002"}
    assert "flowrl channel" in proc.stdout and "WARNING" not in proc.stderr  # the two ends close in order
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
