"""The suite's split over xdist workers (tests/conftest.py): whole modules to a worker, the Ray
tests together, under the very command `.ci/run` runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.conftest import FIRST, ROOT, group_of


def test_every_long_group_named_first_is_a_module_or_folder_of_the_suite():
    assert len(set(FIRST)) == len(FIRST)
    for name in FIRST:
        assert (ROOT / name).exists(), f"tests/conftest.py FIRST names {name!r}, which is not under tests/"


def test_the_ray_tests_are_one_group_and_every_other_module_its_own():
    def nodeid(p):
        return f"{p.relative_to(ROOT.parent).as_posix()}::test_x[a::b]"

    assert {group_of(nodeid(p)) for p in (ROOT / "ray").glob("test_*.py")} == {"ray"}
    others = [p for p in ROOT.rglob("test_*.py") if "ray" not in p.relative_to(ROOT).parts[:1]]
    assert len({group_of(nodeid(p)) for p in others}) == len(others)
    assert group_of("tests/fault/test_shapes.py::test_x[shape0]") == "fault/test_shapes.py"
    assert group_of("tests/fault/test_shapes.py::Class::test_y") == "fault/test_shapes.py"
    assert group_of("elsewhere/test_x.py::test_z") == "elsewhere/test_x.py"


def ci_pytest_flags() -> list[str]:
    """The flags `.ci/run` gives pytest for the main suite (the README's command)."""
    for line in (ROOT.parent / ".ci" / "run").read_text().splitlines():
        if "python -m pytest" in line and "tests/engines" not in line:
            return shlex.split(line.split("python -m pytest", 1)[1])
    raise AssertionError(".ci/run runs no `python -m pytest` for the main suite")


@pytest.mark.timeout(300)
def test_under_the_ci_command_every_module_runs_whole_on_one_worker():
    """Two modules under `.ci/run`'s flags, each test's worker read from the verbose report. With
    xdist's own `loadgroup` under pytest 9.2 (groups read from an id suffix pytest no longer lets
    xdist add) the tests of a module went to both workers, and so did its module-scoped fixtures."""
    flags = ci_pytest_flags()
    assert "-n" in flags
    modules = ["tests/transport/test_flow.py", "tests/transport/test_ragged.py"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    out = subprocess.run([sys.executable, "-m", "pytest", *flags, "-v", "-v", "-p", "no:cacheprovider", *modules],
                         cwd=ROOT.parent, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for worker, nodeid in re.findall(r"\[(gw\d+)\][^\n]*?PASSED (\S+)", out.stdout):
        workers[nodeid.split("::", 1)[0]].add(worker)
    assert set(workers) == set(modules), out.stdout[-3000:]
    split = {g: sorted(w) for g, w in workers.items() if len(w) > 1}
    assert not split, f"modules whose tests ran on more than one worker: {split}"
