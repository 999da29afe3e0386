"""The run's store-outage bookkeeping: backoff, what status() says, and the give-up point."""

from __future__ import annotations

import time

import pytest

from vcdask.engine.outage import BACKOFF_FIRST, StoreOutage
from vcdask.errors import StoreUnreachableError


def test_outage_backs_off_and_ends():
    outage = StoreOutage(timeout=60)
    assert not outage.holding() and outage.back() is None and outage.why is None
    assert outage.fault(StoreUnreachableError("503 Slow Down")) is True  # starts the outage
    assert outage.holding() and outage.why.startswith("store unavailable for 0 s: 503 Slow Down")
    first = outage.wait_seconds()
    assert 0 < first <= BACKOFF_FIRST
    assert outage.fault(StoreUnreachableError("503 again")) is False  # the same outage
    assert BACKOFF_FIRST < outage.wait_seconds() <= 2 * BACKOFF_FIRST  # doubled
    lasted = outage.back()
    assert lasted is not None and lasted >= 0
    assert outage.why is None and outage.back() is None


def test_outage_past_its_timeout_names_the_option():
    outage = StoreOutage(timeout=0.05)
    outage.fault(StoreUnreachableError("connection refused"))
    time.sleep(0.1)
    with pytest.raises(
        RuntimeError,
        match=r"store was unavailable for 0 s, longer than store_outage_timeout=0.05 s; "
        r"last fault: connection refused",
    ):
        outage.fault(StoreUnreachableError("connection refused"))
