"""Store outages seen by a run's tasks: since when, why, and how long dispatch holds off.

A task that fails because the store did not answer (the parameters it starts from, the data staged
in the store, or its upload) is neither its worker's fault nor its shard's.  The run parks its work
and re-issues it with exponential backoff, and gives up only once the store has been out for longer
than ``store_outage_timeout``.
"""

from __future__ import annotations

import time

__all__ = ["StoreOutage"]

BACKOFF_FIRST = 0.5  # seconds dispatch holds off after the first fault; doubles per fault
BACKOFF_MAX = 15.0


class StoreOutage:
    """The outage state of one run (event loop only).

    Parameters
    ----------
    timeout : float
        Seconds the store may stay out before :meth:`fault` raises.
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.since: float | None = None  # monotonic time of the first fault of the current outage
        self.why: str | None = None  # what status()["paused"] says while it lasts
        self.hold_until = 0.0
        self.faults = 0

    def fault(self, exc: BaseException) -> bool:
        """Record a store fault; return whether it starts an outage.

        Raises
        ------
        RuntimeError
            When the store has been out for longer than the timeout (naming ``store_outage_timeout``).
        """
        now = time.monotonic()
        started = self.since is None
        if started:
            self.since = now
        waited = now - self.since
        if waited > self.timeout:
            raise RuntimeError(f"the store was unavailable for {waited:.0f} s, longer than store_outage_timeout="
                               f"{self.timeout:g} s; last fault: {exc}") from exc
        self.faults += 1
        self.why = f"store unavailable for {waited:.0f} s: {exc}"
        self.hold_until = now + min(BACKOFF_FIRST * 2 ** min(self.faults - 1, 6), BACKOFF_MAX)
        return started

    def back(self) -> float | None:
        """The store answered: end the outage; return how long it lasted (None if there was none)."""
        lasted = None if self.since is None else time.monotonic() - self.since
        self.since, self.why, self.faults = None, None, 0
        return lasted

    def holding(self) -> bool:
        """Whether dispatch still holds off (backoff after the latest fault)."""
        return time.monotonic() < self.hold_until

    def wait_seconds(self) -> float:
        """Seconds left of the current backoff."""
        return max(0.0, self.hold_until - time.monotonic())
