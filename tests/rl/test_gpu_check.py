"""benchmarks/gpu_check.py: skips cleanly without CUDA; its code runs end to end over gloo (--cpu)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would run for real")
@pytest.mark.timeout(60)
def test_gpu_check_without_cuda_exits_0_saying_it_skipped():
    out = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=50,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "gpu_check: skipped, no CUDA device is visible" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_check_runs_its_trainer_and_publish_paths_over_gloo_and_prints_the_table():
    out = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--mb", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=230, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split("  ")[0]: line for line in out.stdout.splitlines()}
    assert "2 rank(s), gloo" in rows["DP actor step"]
    gap = float(rows["DP actor step"].split("params vs 1 rank: ")[1].split()[0])
    assert gap < 1e-5
    assert "bitwise=True" in rows["weight publish"] and "raw broadcast" in rows
    assert "applied bitwise=True" in rows["LoRA adapter sync"]  # base + B @ A, as the trainer computes it
    assert "bitwise=True" in rows["memfd handoff"] and "bitwise=True" in rows["sleep / wake"]
