"""One process's recent span seconds, and each span's share of a trailing window (busy and wait ratios).

    act = Activity()
    act.add(since=10.0, t=10.5, spans={"compute": 0.3, "wait_input": 0.2})   # one snapshot's spans
    act.shares(5.0)        # {"compute": 0.6, "wait_input": 0.4}: seconds per span / seconds covered
    act.forget_before(4.0) # entries that ended before 4.0 go

A snapshot covers `since`..`t` (the node's previous drain to this one). Over the last `window_s`
before the newest snapshot's end, a snapshot inside the window counts whole and one that straddles
its start counts pro rata; `covered` is the time the counted snapshots cover.

The controller asks for every process's shares once a step (its row), so the answer comes from
running totals kept as snapshots arrive: the snapshots wholly inside the window are one subtraction,
and only those straddling its start are looked at one by one. Snapshots of one process arrive in
order (their `since` and `t` never go back); one that does makes the shares fall back to a walk
over the window's snapshots, with the same result.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque

MAX_ENTRIES = 10_000  # a process that floods snapshots keeps only its newest


class Activity:
    """The snapshots of one process, oldest first, with running totals (see the module docstring)."""

    __slots__ = ("entries", "ends", "in_order", "_covered", "_seconds", "_counts")

    def __init__(self) -> None:
        # (since, t, spans, covered before it, {span: seconds} before it, {span: entries} before it)
        self.entries: deque = deque()
        self.ends: deque = deque()  # t of each entry, for the window's start
        self.in_order = True
        self._covered = 0.0  # running totals over every entry added (forgotten ones too)
        self._seconds: dict[str, float] = {}
        self._counts: dict[str, int] = {}  # entries that name each span: a span is in a window iff one there does

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, since: float, t: float, spans: dict[str, float]) -> None:
        if self.entries:
            last_since, last_t = self.entries[-1][0], self.entries[-1][1]
            if since < last_since or t < last_t:
                self.in_order = False
        if len(self.entries) >= MAX_ENTRIES:
            self.entries.popleft()
            self.ends.popleft()
        self.entries.append((since, t, spans, self._covered, dict(self._seconds), dict(self._counts)))
        self.ends.append(t)
        self._covered += max(0.0, t - since)
        seconds, counts = self._seconds, self._counts
        for span, v in spans.items():
            seconds[span] = seconds.get(span, 0.0) + v
            counts[span] = counts.get(span, 0) + 1

    def forget_before(self, t: float) -> None:
        """Drop the oldest entries that ended before `t`."""
        entries, ends = self.entries, self.ends
        while ends and ends[0] < t:
            entries.popleft()
            ends.popleft()

    def shares(self, window_s: float) -> dict[str, float] | None:
        """Seconds per span / seconds covered over the last `window_s` (None: nothing covered)."""
        if not self.entries:
            return None
        if not self.in_order:
            return _walk(self.entries, window_s)
        entries = self.entries
        start = entries[-1][1] - window_s
        i = bisect_right(self.ends, start)  # the first entry that ends inside the window
        covered, seconds = 0.0, {}
        n = len(entries)
        while i < n and entries[i][0] < start:  # straddles the start: pro rata
            since, t, spans = entries[i][:3]
            dur = t - since
            frac = (t - start) / dur
            covered += t - start
            for span, v in spans.items():
                seconds[span] = seconds.get(span, 0.0) + v * frac
            i += 1
        if i < n:  # wholly inside: the running totals since entry i
            covered_before, seconds_before, counts_before = entries[i][3:6]
            covered += self._covered - covered_before
            for span, count in self._counts.items():
                if count > counts_before.get(span, 0):
                    seconds[span] = seconds.get(span, 0.0) + self._seconds[span] - seconds_before.get(span, 0.0)
        if covered <= 0:
            return None
        return {span: v / covered for span, v in seconds.items()}


def _walk(entries, window_s: float) -> dict[str, float] | None:
    """The shares by walking back from the newest entry (entries out of order)."""
    end = entries[-1][1]
    start = end - window_s
    covered, seconds = 0.0, {}
    for since, t, spans, *_ in reversed(entries):
        if t <= start:
            break
        dur = t - since
        frac = 1.0 if dur <= 0 else min(1.0, (t - max(since, start)) / dur)
        covered += max(0.0, min(dur, t - start))
        for span, v in spans.items():
            seconds[span] = seconds.get(span, 0.0) + v * frac
    if covered <= 0:
        return None
    return {span: v / covered for span, v in seconds.items()}
