"""Weight groups between real processes over gloo: bitwise equal weights, clear failures, no hangs."""

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]


def run_pair(mode: str) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.weights.peer", role, str(store.port), mode], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for role in ("pub", "sub")]
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=60)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out[0], out[1]


def test_subscriber_holds_bitwise_equal_weights_after_a_broadcast():
    pub, sub = run_pair("ok")
    assert pub.returncode == 0, pub.stderr
    assert sub.returncode == 0 and "EQUAL" in sub.stdout, sub.stdout + sub.stderr


def test_layout_mismatch_is_a_clear_error_on_the_subscriber():
    _, sub = run_pair("mismatch")
    assert "SYNC_ERROR" in sub.stdout and "same model architecture" in sub.stdout


def test_publisher_dying_mid_sync_is_an_error_not_a_hang():
    pub, sub = run_pair("die")
    assert pub.returncode == -9
    assert sub.returncode == 3 and "SYNC_ERROR" in sub.stdout
