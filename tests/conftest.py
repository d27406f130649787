"""How the suite splits over pytest-xdist workers (`python -m pytest -n 2 --dist loadscope`, the README's
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


def precompile() -> None:
    """Byte-compile the project's sources into their `__pycache__` folders (git ignores them).

    Where PYTHONDONTWRITEBYTECODE is set (CI machines often set it), no Python process writes them,
    so every process the suite starts (each run's controller and fork server, each `python -m`
    helper, some hundreds in all) compiled the flowrl modules it imports again: ~0.13 s of CPU
    each on 2 cores. Reading compiled files needs no permission from that setting; `compileall`
    writes them whatever it says, atomically, and skips files already up to date."""
    import compileall

    for folder in ("flowrl", "nodes", "tests", "benchmarks", "examples"):
        if (ROOT.parent / folder).is_dir():
            compileall.compile_dir(ROOT.parent / folder, quiet=2, workers=1)


def group_of(nodeid: str) -> str:
    """A test's group, from its id: its module's path under tests/ ("ray" for every Ray test)."""
    module = nodeid.split("::", 1)[0].replace("\\", "/")
    rel = module.removeprefix("tests/")
    return "ray" if rel.startswith("ray/") else rel


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # once, in the process that starts the workers
        precompile()
    if hasattr(config.option, "loadscopereorder"):  # xdist: hand out the groups in this file's order,
        config.option.loadscopereorder = False       # not by how many tests each has


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: without it installed, none of this runs
def pytest_xdist_make_scheduler(config, log):
    """Whole groups to a worker, the group read from the test id itself. Not xdist's `loadgroup`
    with `xdist_group` marks: it tells a test's group by a suffix it appends to the test's id, which
    pytest 9.2 no longer lets it change (ids became structured), so there every test went out
    alone, and each worker ran the modules' chaos campaigns and a Ray cluster of its own."""
    if config.getvalue("dist") not in ("loadscope", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    # stable: within a group (a module) the tests keep their order, and so do the groups not listed
    rank = {g: i for i, g in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(FIRST)))
