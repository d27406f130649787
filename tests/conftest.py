"""How the suite splits over pytest-xdist workers (`python -m pytest -n 2 --dist loadgroup`, the README's
test command).

Every test module is one xdist group, so a module-scoped fixture (a chaos campaign, a trained model)
runs once, on one worker; the Ray tests are one group of their own, so that only one loopback Ray
cluster exists at a time (their session fixture starts one per worker). The groups known to take
longest go first, so that the two workers finish together instead of one waiting on the last
long module. Without xdist this changes only the order the modules run in.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent

FIRST = ("ray", "fault/test_shapes.py", "fault/test_chaos.py", "runtime/test_shapes_cases.py",
         "runtime/test_pipeline.py", "runtime/test_take_turns.py", "integration/test_data_parallel_ppo.py",
         "integration/test_rl_runs.py", "integration/test_agents.py", "weights/test_sync.py",
         "runtime/test_rank_collectives.py")
"""The groups that run longest on 2 cores (40 s to 5 min each, `--durations=0`), longest first."""


def group_of(path: Path) -> str:
    try:
        rel = path.resolve().relative_to(ROOT).as_posix()
    except ValueError:  # not under tests/ (a file named on the command line elsewhere)
        return str(path)
    return "ray" if rel.startswith("ray/") else rel


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist: hand out the groups in this file's order,
        config.option.loadscopereorder = False       # not by how many tests each has


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    rank = {g: i for i, g in enumerate(FIRST)}
    groups = {}
    for item in items:
        groups[item.nodeid] = group = group_of(item.path)
        item.add_marker(pytest.mark.xdist_group(group))
    # stable: within a group (a module) the tests keep their order, and so do the groups not listed
    items.sort(key=lambda item: rank.get(groups[item.nodeid], len(FIRST)))
