"""benchmarks/pipeline.py --repeat: each row is the case's median round, with every round's ratio."""

from __future__ import annotations

from tests.benchmark_modules import benchmark


def _median_rows():
    return benchmark("pipeline").median_rows


def test_each_row_is_its_median_round_with_its_critical_path_and_every_rounds_ratio():
    median_rows = _median_rows()
    rounds = [[{"case": "k=0", "ratio": r, "measured_per_s": 7 * r, "bound_per_s": 7.0, "critical_path": [f"path {r}"]},
               {"case": "k=1", "ratio": 1 - r / 10, "measured_per_s": 1.0, "bound_per_s": 1.0}]
              for r in (0.93, 0.95, 0.94)]
    k0, k1 = median_rows(rounds)
    assert k0["ratio"] == 0.94 and k0["critical_path"] == ["path 0.94"] and k0["ratios"] == [0.93, 0.95, 0.94]
    assert k1["ratio"] == 1 - 0.094 and k1["ratios"] == [1 - 0.093, 1 - 0.095, 1 - 0.094]
    two = median_rows(rounds[:2])[0]  # an even count: the lower of the middle two
    assert two["ratio"] == 0.93 and two["ratios"] == [0.93, 0.95]
