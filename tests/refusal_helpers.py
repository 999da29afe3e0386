"""Checks that ``fit`` refuses its arguments before any cluster or store work (shared by the refusal tests)."""

from __future__ import annotations

import pytest

import vcdask


class NoCluster:
    """A client stand-in that fails the test if fit ever reaches for the cluster."""

    scheduler_address = "tcp://127.0.0.1:1"
    asynchronous = False  # (fit asks whether a client is asynchronous first: no cluster work)

    def __getattr__(self, name):
        raise AssertionError(f"fit touched the cluster ({name}) before rejecting its input")


def refused(model, data, tmp_path, exc, *fragments, **kwargs) -> str:
    """fit refuses ``model`` or ``data`` before touching the cluster or the store; its message holds every fragment."""
    store = tmp_path / "store"
    with pytest.raises(exc) as info:
        vcdask.fit(model, data, client=NoCluster(), store=store, progress=False, **kwargs)
    assert not store.exists(), "the store was created before the input was rejected"
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message
