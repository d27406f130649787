"""Peers in their own processes, always killed by PID at the end of the test."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class Peers:
    def __init__(self):
        self.secret = secrets.token_hex(32)
        self.procs: list[subprocess.Popen] = []

    def start(self, role: str, cfg: dict) -> subprocess.Popen:
        env = {**os.environ, "FLOWRL_TEST_SECRET": self.secret, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        p = subprocess.Popen([sys.executable, "-m", "tests.weights.peers", role, json.dumps(cfg)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    @staticmethod
    def results(p: subprocess.Popen, timeout: float = 60) -> list[dict]:
        out, err = p.communicate(timeout=timeout)
        lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        assert lines, f"peer printed nothing (exit {p.returncode}): {err[-2000:]}"
        return lines

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdout, p.stderr):
                if f:
                    f.close()


@pytest.fixture
def peers():
    ps = Peers()
    try:
        yield ps
    finally:
        ps.close()
