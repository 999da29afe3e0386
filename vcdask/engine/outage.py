"""Store outages: one backoff schedule, the merge thread's retry loop, and the tasks' outage state.

Two things wait for the store, and neither blames a worker or a shard:

* the merge thread, reading an update or committing, retries with :func:`retry_through` while
  the store is out past its own retries (the run pauses there);
* shard and validation tasks that failed on a store fault are parked; :class:`StoreOutage` holds
  dispatch off with backoff and re-issues them.

Both give up once the store has been out for longer than ``store_outage_timeout``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import StoreAccessDeniedError, StoreConflict, StoreError, StoreNotFoundError, StoreOutageError

__all__ = ["BACKOFF_FIRST", "BACKOFF_MAX", "StoreOutage", "backoff", "retry_through"]

logger = logging.getLogger(__name__)

BACKOFF_FIRST = 0.5  # seconds to hold off after the first fault; doubles per fault
BACKOFF_MAX = 15.0  # dispatch's longest hold-off
RETRY_MAX = 30.0  # the merge thread's longest sleep between tries

T = TypeVar("T")


def backoff(faults: int, cap: float = BACKOFF_MAX) -> float:
    """Seconds to wait after the ``faults``-th consecutive fault (1, 2, ...): 0.5, 1, 2, 4 ... up to ``cap``."""
    return min(BACKOFF_FIRST * 2 ** min(max(faults, 1) - 1, 16), cap)


def retry_through(
    fn: Callable[[], T], what: str, timeout: float, *, on_wait: Callable[[str | None], None] | None = None
) -> T:
    """``fn()``, retried with :func:`backoff` while the store is unavailable, for up to ``timeout`` s.

    A missing object, a refused credential or a conflict is not transient and is raised at once.
    ``on_wait(why)`` is told why it waits (None once ``fn`` succeeded).

    Raises
    ------
    StoreOutageError
        The store was out for longer than ``timeout`` (the message names ``store_outage_timeout``).
    """
    started, faults = time.monotonic(), 0
    while True:
        try:
            out = fn()
        except (StoreNotFoundError, StoreAccessDeniedError, StoreConflict):
            raise
        except StoreError as e:
            waited = time.monotonic() - started
            if waited > timeout:
                raise StoreOutageError(
                    f"{what}: the store was unavailable for {waited:.0f} s, longer than "
                    f"store_outage_timeout={timeout:g} s: {e}"
                ) from e
            faults += 1
            delay = backoff(faults, RETRY_MAX)
            why = f"store unavailable for {waited:.0f} s ({what}): {e}"
            if on_wait is not None:
                on_wait(why)
            logger.warning("paused: %s; retrying in %.1f s", why, delay)
            time.sleep(delay)
            continue
        if on_wait is not None:
            on_wait(None)
        return out


class StoreOutage:
    """The outage state seen by one run's tasks (the event loop only).

    Parameters
    ----------
    timeout : float
        Seconds the store may stay out before :meth:`fault` raises.
    clock : callable, optional
        Monotonic seconds (default :func:`time.monotonic`).
    """

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self.clock = clock
        self.since: float | None = None  # monotonic time of the first fault of the current outage
        self.why: str | None = None  # what status()["paused"] says while it lasts
        self.hold_until = 0.0
        self.faults = 0

    def fault(self, exc: BaseException) -> bool:
        """Record a store fault; return whether it starts an outage.

        Raises
        ------
        StoreOutageError
            When the store has been out for longer than the timeout (naming ``store_outage_timeout``).
        """
        now = self.clock()
        started = self.since is None
        if self.since is None:
            self.since = now
        waited = now - self.since
        if waited > self.timeout:
            raise StoreOutageError(
                f"the store was unavailable for {waited:.0f} s, longer than "
                f"store_outage_timeout={self.timeout:g} s; last fault: {exc}"
            ) from exc
        self.faults += 1
        self.why = f"store unavailable for {waited:.0f} s: {exc}"
        self.hold_until = now + backoff(self.faults)
        return started

    def back(self) -> float | None:
        """The store answered: end the outage; return how long it lasted (None if there was none)."""
        lasted = None if self.since is None else self.clock() - self.since
        self.since, self.why, self.faults = None, None, 0
        return lasted

    def holding(self) -> bool:
        """Whether dispatch still holds off (backoff after the latest fault)."""
        return self.clock() < self.hold_until

    def wait_seconds(self) -> float:
        """Seconds left of the current backoff."""
        return max(0.0, self.hold_until - self.clock())
