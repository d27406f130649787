"""Metric kinds carry their reduction: combining replicas gives the numbers of the whole."""

from __future__ import annotations

import msgpack
import pytest

from flowrl.metrics.kinds import KINDS, Gauge, Histogram, Max, Mean, Min, Sum
from flowrl.metrics.rows import reduce_values


def test_means_from_replicas_are_weighted_by_count_not_averaged():
    a, b = Mean(), Mean()
    a.add(1.0, weight=3)  # replica 0: 3 samples of reward 1
    b.add(5.0)  # replica 1: 1 sample of reward 5
    assert reduce_values([a, b]).summary() == {"_mean": 2.0}  # (3*1 + 5) / 4, not (1+5)/2


def test_sums_add_and_max_min_keep_the_extremes():
    assert reduce_values([Sum(64), Sum(32), None]).summary() == {"": 96}
    m1, m2 = Max(), Max()
    m1.add(1), m2.add(3), m2.add(2)
    assert reduce_values([m1, m2]).summary() == {"_max": 3}
    n1, n2 = Min(), Min()
    n1.add(0.5), n2.add(0.25)
    assert reduce_values([n1, n2]).summary() == {"_min": 0.25}


def test_histograms_from_replicas_merge_by_adding_bucket_counts():
    bounds = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    a, b = Histogram(bounds), Histogram(bounds)
    for v in range(1, 51):
        a.add(v)
    for v in range(51, 101):
        b.add(v)
    merged = reduce_values([a, b])
    assert merged.count == 100 and merged.total == sum(range(1, 101))
    assert merged.counts == [10] * 10 + [0]
    s = merged.summary()
    assert s["_p50"] == pytest.approx(50.0)
    assert s["_p95"] == pytest.approx(95.0)
    assert s["_p99"] == pytest.approx(99.0)
    assert s["_max"] == 100 and s["_mean"] == pytest.approx(50.5) and s["_count"] == 100


def test_histogram_quantiles_stay_within_the_values_seen():
    h = Histogram("latency_s")
    for v in (0.12, 0.13, 0.14):
        h.add(v)  # all in the (0.1, 0.25] bucket
    assert 0.12 <= h.quantile(0.5) <= 0.14
    assert h.quantile(0.99) <= 0.14
    h.add(float("nan"))  # no bucket for NaN: ignored, not poisoning the sum
    assert h.count == 3


def test_histograms_with_different_buckets_refuse_to_merge():
    with pytest.raises(ValueError, match="different buckets"):
        Histogram("latency_s").merge(Histogram("staleness"))


def test_gauges_combine_across_replicas_by_their_rule():
    assert reduce_values([Gauge(2.0, 1, "mean"), Gauge(4.0, 2, "mean"), Gauge(6.0, 3, "mean")]).value == 4.0
    assert reduce_values([Gauge(2.0, 1, "max"), Gauge(7.0, 2, "max")]).value == 7.0
    assert reduce_values([Gauge(2.0, 5, "last"), Gauge(7.0, 2, "last")]).value == 2.0
    assert reduce_values([Gauge(2.0, 1, "sum"), Gauge(7.0, 2, "sum")]).value == 9.0
    same = Gauge(1.0, 1.0)
    same.merge(Gauge(3.0, 2.0))  # within one series the newest value wins
    assert same.value == 3.0
    with pytest.raises(ValueError, match="across replicas"):
        Gauge(1.0, 0, "median")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_survives_a_msgpack_round_trip(kind):
    value = {"sum": Sum(3), "mean": Mean(3.0, 2.0), "max": Max(4), "min": Min(1),
             "gauge": Gauge(5.0, 1.0, "max"), "hist": Histogram("staleness", None)}[kind]
    if kind == "hist":
        value.add(2)
    back = KINDS[kind].from_wire(msgpack.unpackb(msgpack.packb(value.wire())))
    assert back.summary() == value.summary()
