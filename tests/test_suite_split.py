"""The suite's split over xdist workers (tests/conftest.py) names modules that exist, and keeps the
Ray tests together."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import FIRST, ROOT, group_of


def test_every_long_group_named_first_is_a_module_or_folder_of_the_suite():
    assert len(set(FIRST)) == len(FIRST)
    for name in FIRST:
        assert (ROOT / name).exists(), f"tests/conftest.py FIRST names {name!r}, which is not under tests/"


def test_the_ray_tests_are_one_group_and_every_other_module_its_own():
    assert {group_of(p) for p in (ROOT / "ray").glob("test_*.py")} == {"ray"}
    others = [p for p in ROOT.rglob("test_*.py") if "ray" not in p.relative_to(ROOT).parts[:1]]
    assert len({group_of(p) for p in others}) == len(others)
    assert group_of(ROOT / "fault" / "test_shapes.py") == "fault/test_shapes.py"
    assert group_of(Path("/elsewhere/test_x.py")) == "/elsewhere/test_x.py"
