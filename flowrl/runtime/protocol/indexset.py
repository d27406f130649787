"""`IndexSet`: a set of ticket indices kept as a watermark plus the few above it.

Tickets complete mostly in order, so "every index below `low`, plus these" stays small however
long the run is: memory is O(out-of-order window), not O(steps).

    s = IndexSet()
    s.add(0); s.add(2)          # low == 1, extras == {2}
    s.add(1)                    # low == 3, extras == set()
    5 in s, 1 in s              # False, True
"""

from __future__ import annotations


class IndexSet:
    __slots__ = ("low", "extras")

    def __init__(self, low: int = 0, extras=()):
        self.low = low
        self.extras: set[int] = set()
        for i in extras:
            self.add(i)

    def __contains__(self, i: int) -> bool:
        return i < self.low or i in self.extras

    def add(self, i: int) -> bool:
        """Add `i`; False if it was already there."""
        if i in self:
            return False
        self.extras.add(i)
        while self.low in self.extras:
            self.extras.discard(self.low)
            self.low += 1
        return True

    def truncate(self, n: int) -> list[int]:
        """Remove every index >= n; returns the removed ones (ascending)."""
        removed = sorted(i for i in self.extras if i >= n)
        self.extras -= set(removed)
        if self.low > n:
            removed = list(range(n, self.low)) + removed
            self.low = n
            # extras below n stay below: they cannot exceed low-1 < n, so none is lost
        return removed

    def above(self, n: int) -> list[int]:
        """Members >= n, ascending."""
        return list(range(n, self.low)) + sorted(i for i in self.extras if i >= n)

    def __repr__(self) -> str:
        return f"IndexSet(low={self.low}, extras={sorted(self.extras)})"
