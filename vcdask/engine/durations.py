"""Measured seconds (of shard tasks, of validations) that the run's deadlines derive from.

A long run's deadlines are derived several times a second on the scheduler's event loop (the deadline
watchdog's tick, each cold copy, each validation sent), from every time measured so far: the median of
100,000 shard times took 48 ms each time with :func:`statistics.median`.  :class:`Durations` keeps them
sorted as they come in, so the median and the total cost nothing to read.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterator, Sequence
from typing import Any, overload

__all__ = ["Durations", "median_of", "total_of"]


class Durations(Sequence[float]):
    """Seconds in the order they were measured (a sequence: ``len``, index, slice, iterate, compare with a
    list), grown with :meth:`append`; :meth:`median` and :attr:`total` in O(1)."""

    __slots__ = ("_order", "_sorted", "total")

    def __init__(self, values: Sequence[float] = ()) -> None:
        self._order: list[float] = []
        self._sorted: list[float] = []
        self.total = 0.0
        for value in values:
            self.append(value)

    def append(self, seconds: float) -> None:
        seconds = float(seconds)
        self._order.append(seconds)
        bisect.insort(self._sorted, seconds)
        self.total += seconds

    def median(self) -> float:
        """The median, as :func:`statistics.median` gives it.

        Raises
        ------
        statistics.StatisticsError
            Nothing is measured yet.
        """
        n = len(self._sorted)
        if not n:
            raise statistics.StatisticsError("no median for empty data")
        mid = n // 2
        return self._sorted[mid] if n % 2 else (self._sorted[mid - 1] + self._sorted[mid]) / 2

    def __len__(self) -> int:
        return len(self._order)

    @overload
    def __getitem__(self, index: int) -> float: ...
    @overload
    def __getitem__(self, index: slice) -> list[float]: ...
    def __getitem__(self, index: int | slice) -> float | list[float]:
        return self._order[index]

    def __iter__(self) -> Iterator[float]:
        return iter(self._order)

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, Durations):
            return self._order == other._order
        return self._order == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # (mutable, as a list)

    def __repr__(self) -> str:
        return f"Durations({self._order!r})"


def median_of(seconds: Sequence[float]) -> float:
    """The median of ``seconds``: read off a :class:`Durations`, computed for any other sequence."""
    return seconds.median() if isinstance(seconds, Durations) else statistics.median(seconds)


def total_of(seconds: Sequence[float]) -> float:
    """The sum of ``seconds``: kept by a :class:`Durations`, computed for any other sequence."""
    return seconds.total if isinstance(seconds, Durations) else float(sum(seconds))
