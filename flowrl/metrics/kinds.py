"""Metric kinds that carry their own reduction.

A node process only knows its own numbers; the controller sees many replicas of many nodes. Each
kind therefore says how two partial values combine, so the controller never averages averages:

    >>> a, b = Mean(), Mean()
    >>> a.add(1.0); a.add(1.0); b.add(4.0)      # replica 0 saw two samples, replica 1 one
    >>> a.merge(b); a.summary()
    {'_mean': 2.0}

Every kind travels as a short list of plain numbers (`wire()` / `from_wire()`), so snapshots stay
msgpack-able and small. Histograms use fixed buckets (a preset name or an explicit bound list) so
that histograms from different processes merge by adding counts, like Prometheus histograms.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, ClassVar

# Upper bounds (inclusive, Prometheus `le`) of each preset; a final +Inf bucket is implicit.
BUCKET_PRESETS: dict[str, tuple[float, ...]] = {
    "latency_s": (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                  30.0, 60.0, 120.0, 300.0),
    "staleness": (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64),
    "default": tuple(m * 10.0 ** e for e in range(-3, 7) for m in (1, 2, 5)),
}


def default_buckets(name: str) -> str:
    """The preset a histogram gets when its recorder names none: seconds, versions, or 1-2-5."""
    if name.endswith("_s") or name.endswith("_seconds"):
        return "latency_s"
    if "staleness" in name:
        return "staleness"
    return "default"


def resolve_buckets(spec: str | list | tuple) -> tuple[float, ...]:
    if isinstance(spec, str):
        if spec not in BUCKET_PRESETS:
            raise ValueError(f"unknown histogram bucket preset {spec!r}; "
                             f"use one of {sorted(BUCKET_PRESETS)} or a list of increasing bounds")
        return BUCKET_PRESETS[spec]
    bounds = tuple(float(b) for b in spec)
    if not bounds or any(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:])):
        raise ValueError(f"histogram bounds must be a non-empty increasing list, got {list(spec)}")
    return bounds


class Reduction:
    """One partial value of one series; `merge` must be associative and commutative."""

    kind: ClassVar[str]

    def wire(self) -> list:
        raise NotImplementedError

    def merge(self, other: Reduction) -> None:
        raise NotImplementedError

    def summary(self) -> dict[str, float | None]:
        """Row suffix -> value, e.g. {"_mean": 0.7}; empty when nothing was recorded."""
        raise NotImplementedError

    def copy(self) -> Reduction:
        return type(self).from_wire(self.wire())

    @classmethod
    def from_wire(cls, payload: list) -> Reduction:
        raise NotImplementedError


class Sum(Reduction):
    """Counts: samples, tokens, bytes. Replicas add."""

    kind = "sum"

    def __init__(self, value: float = 0):
        self.value = value

    def add(self, value: float) -> None:
        self.value += value

    def merge(self, other: Reduction) -> None:
        self.value += other.value

    def wire(self) -> list:
        return [self.value]

    def summary(self) -> dict[str, float | None]:
        return {"": self.value}

    @classmethod
    def from_wire(cls, payload: list) -> Sum:
        (value,) = payload
        return cls(value)


class Mean(Reduction):
    """Averages weighted by how many things were averaged: reward per sample, loss per token."""

    kind = "mean"

    def __init__(self, total: float = 0.0, weight: float = 0.0):
        self.total, self.weight = total, weight

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total += value * weight
        self.weight += weight

    def merge(self, other: Reduction) -> None:
        self.total += other.total
        self.weight += other.weight

    def wire(self) -> list:
        return [self.total, self.weight]

    def summary(self) -> dict[str, float | None]:
        return {"_mean": self.total / self.weight} if self.weight > 0 else {}

    @classmethod
    def from_wire(cls, payload: list) -> Mean:
        total, weight = payload
        return cls(total, weight)


class Max(Reduction):
    """Worst case over the window: staleness, queue high-water mark."""

    kind = "max"
    suffix = "_max"
    pick = staticmethod(max)

    def __init__(self, value: float | None = None):
        self.value = value

    def add(self, value: float) -> None:
        self.value = value if self.value is None else self.pick(self.value, value)

    def merge(self, other: Reduction) -> None:
        if other.value is not None:
            self.add(other.value)

    def wire(self) -> list:
        return [self.value]

    def summary(self) -> dict[str, float | None]:
        return {} if self.value is None else {self.suffix: self.value}

    @classmethod
    def from_wire(cls, payload: list) -> Max:
        (value,) = payload
        return cls(value)


class Min(Max):
    kind = "min"
    suffix = "_min"
    pick = staticmethod(min)


GAUGE_ACROSS = ("mean", "max", "min", "sum", "last")


class Gauge(Reduction):
    """A current value (policy version, RSS). Within one series the newest wins; across series
    (replicas) `across` says how to combine: RSS of two replicas averages, versions take the max."""

    kind = "gauge"

    def __init__(self, value: float | None = None, t: float = 0.0, across: str = "mean",
                 n: int = 1):
        if across not in GAUGE_ACROSS:
            raise ValueError(f"gauge reduction across replicas is {across!r}; use one of {GAUGE_ACROSS}")
        self.value, self.t, self.across, self.n = value, t, across, n

    def set(self, value: float, t: float) -> None:
        self.value, self.t, self.n = value, t, 1

    def merge(self, other: Reduction) -> None:
        """Same series: newest wins (n stays 1). Use `combine` to reduce across series."""
        if other.value is not None and (self.value is None or other.t >= self.t):
            self.value, self.t = other.value, other.t

    def combine(self, other: Gauge) -> None:
        if other.value is None:
            return
        if self.value is None:
            self.value, self.t, self.n = other.value, other.t, other.n
            return
        a, b = self.value, other.value
        if self.across == "mean":
            self.value = (a * self.n + b * other.n) / (self.n + other.n)
        elif self.across == "sum":
            self.value = a + b
        elif self.across == "max":
            self.value = max(a, b)
        elif self.across == "min":
            self.value = min(a, b)
        elif other.t >= self.t:  # "last"
            self.value = b
        self.n += other.n
        self.t = max(self.t, other.t)

    def wire(self) -> list:
        return [self.value, self.t, self.across]

    def summary(self) -> dict[str, float | None]:
        return {} if self.value is None else {"": self.value}

    @classmethod
    def from_wire(cls, payload: list) -> Gauge:
        value, t, across = payload
        return cls(value, t, across)


class Histogram(Reduction):
    """Latency and staleness distributions: fixed buckets, so replicas merge by adding counts;
    p50/p95/p99 are interpolated within a bucket (as Prometheus' histogram_quantile does), clamped
    to the exact min/max seen."""

    kind = "hist"
    QUANTILES = (0.5, 0.95, 0.99)

    def __init__(self, buckets: str | list | tuple = "default", counts: list[int] | None = None,
                 total: float = 0.0, count: int = 0, lo: float | None = None,
                 hi: float | None = None):
        self.buckets = buckets if isinstance(buckets, str) else list(buckets)
        self.bounds = resolve_buckets(buckets)
        self.counts = list(counts) if counts is not None else [0] * (len(self.bounds) + 1)
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError(f"histogram has {len(self.bounds)} bounds but {len(self.counts)} "
                             f"counts; expected {len(self.bounds) + 1} (one +Inf bucket)")
        self.total, self.count, self.lo, self.hi = total, count, lo, hi

    def add(self, value: float) -> None:
        if value != value:  # NaN has no bucket; it would also poison the sum
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1
        self.lo = value if self.lo is None else min(self.lo, value)
        self.hi = value if self.hi is None else max(self.hi, value)

    def merge(self, other: Reduction) -> None:
        if other.bounds != self.bounds:
            raise ValueError(f"cannot merge histograms with different buckets "
                             f"({self.buckets!r} vs {other.buckets!r}); record the metric with "
                             f"the same `buckets=` in every process")
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total
        self.count += other.count
        for v in (other.lo, other.hi):
            if v is not None:
                self.lo = v if self.lo is None else min(self.lo, v)
                self.hi = v if self.hi is None else max(self.hi, v)

    def quantile(self, q: float) -> float | None:
        if self.count == 0:
            return None
        rank, seen = q * self.count, 0
        for i, c in enumerate(self.counts):
            if c and seen + c >= rank:
                lo = self.bounds[i - 1] if i > 0 else self.lo
                hi = self.bounds[i] if i < len(self.bounds) else self.hi
                lo, hi = max(lo, self.lo), min(hi, self.hi)
                return lo + (hi - lo) * max(0.0, rank - seen) / c
            seen += c
        return self.hi

    def summary(self) -> dict[str, float | None]:
        if self.count == 0:
            return {}
        out: dict[str, float | None] = {f"_p{round(q * 100)}": self.quantile(q) for q in self.QUANTILES}
        out.update(_mean=self.total / self.count, _max=self.hi, _count=self.count)
        return out

    def wire(self) -> list:
        return [self.buckets, self.counts, self.total, self.count, self.lo, self.hi]

    @classmethod
    def from_wire(cls, payload: list) -> Histogram:
        buckets, counts, total, count, lo, hi = payload
        return cls(buckets, counts, total, count, lo, hi)


KINDS: dict[str, type[Reduction]] = {k.kind: k for k in (Sum, Mean, Max, Min, Gauge, Histogram)}


def finite(value: Any) -> float | int | None:
    """JSON has no NaN/Inf; a metric that went non-finite is written as null, not as bad JSON."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if isinstance(value, int) or math.isfinite(value) else None
