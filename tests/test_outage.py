"""The run's store-outage bookkeeping: backoff, what status() says, and the give-up point."""

from __future__ import annotations

import pytest
from test_engine_core import Clock

from vcdask.engine.outage import BACKOFF_FIRST, StoreOutage
from vcdask.errors import StoreUnreachableError


def test_outage_backs_off_and_ends():
    clock = Clock()  # (moves only when told, whatever the machine's load)
    outage = StoreOutage(timeout=60, clock=clock)
    assert not outage.holding() and outage.back() is None and outage.why is None
    assert outage.fault(StoreUnreachableError("503 Slow Down")) is True  # starts the outage
    assert outage.holding() and outage.why.startswith("store unavailable for 0 s: 503 Slow Down")
    assert outage.wait_seconds() == BACKOFF_FIRST
    clock.advance(0.2)
    assert outage.holding() and outage.wait_seconds() == pytest.approx(BACKOFF_FIRST - 0.2)
    assert outage.fault(StoreUnreachableError("503 again")) is False  # the same outage
    assert outage.wait_seconds() == 2 * BACKOFF_FIRST  # doubled, from this fault
    clock.advance(2 * BACKOFF_FIRST)
    assert not outage.holding() and outage.wait_seconds() == 0.0
    clock.advance(1.3)
    assert outage.fault(StoreUnreachableError("503 once more")) is False
    assert outage.why == "store unavailable for 2 s: 503 once more"  # counted from the outage's first fault
    assert outage.back() == pytest.approx(2.5)
    assert outage.why is None and outage.back() is None
    assert outage.fault(StoreUnreachableError("503")) is True  # a new outage: the backoff starts over
    assert outage.wait_seconds() == BACKOFF_FIRST


def test_outage_past_its_timeout_names_the_option():
    clock = Clock()  # (moves only when told, whatever the machine's load)
    outage = StoreOutage(timeout=0.05, clock=clock)
    outage.fault(StoreUnreachableError("connection refused"))
    clock.advance(0.04)
    outage.fault(StoreUnreachableError("connection refused"))  # within its timeout
    clock.advance(0.02)
    with pytest.raises(
        RuntimeError,
        match=r"store was unavailable for 0 s, longer than store_outage_timeout=0.05 s; "
        r"last fault: connection refused",
    ):
        outage.fault(StoreUnreachableError("connection refused"))


def test_a_commit_that_fails_before_it_is_sent_says_so_and_the_server_does_not_look_for_it(tmp_path):
    """A commit whose rule state cannot be written (its folder is blocked by a file) fails before the
    version is sent: the error says so (``unsent``), the branch head is unchanged, and the merge thread
    raises it without reading the branch head to see whether it landed (that read costs another round of
    the store client's retries under an S3 outage)."""
    import torch

    import vcdask
    from vcdask.engine.params_server import ParamsServer
    from vcdask.errors import StoreError
    from vcdask.merge import Nesterov
    from vcdask.params import flatten
    from vcdask.store._state import state_folder

    store = vcdask.open_store(tmp_path / "s")
    flat = flatten(torch.nn.Linear(4, 3))
    store.create_branch("run-x", store.commit(flat, metadata={"step": 0}))
    first = store.commit(flat, metadata={"step": 0}, branch="run-x")
    server = ParamsServer(store, "run-x", Nesterov(delay=1), "run-x", outage_timeout=0)
    server.load()
    server.head = server.head.__class__(1, first, 0)
    server.uncommitted = [{"epoch": 1, "shard": 0, "attempt": 0, "update": "none"}]
    blocked = tmp_path / "s" / "runs" / state_folder("run-x")
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.write_text("not a folder")
    looked, versions = [], store.versions

    def counted(*args, **kwargs):  # the store's own listing, counted: how the server would look for a landing
        looked.append(args)
        return versions(*args, **kwargs)

    store.versions = counted
    with pytest.raises(StoreError, match="store_outage_timeout=0 s") as raised:
        server.commit()
    assert raised.value.__cause__.unsent, raised.value.__cause__  # the store's error, as the server got it
    assert not looked
    del store.versions
    assert store.versions("run-x")[0].id == first  # nothing landed
