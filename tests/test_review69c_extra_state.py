"""A module's ``get_extra_state`` that returns no tensor (a dict, an int, a str: torch's documented use) is refused
before any cluster work, naming the entry and the remedy (it failed the staging after the store was made, or, an
int, every task on its worker); one that returns a tensor trains."""

from __future__ import annotations

import numpy as np
import pytest
import refusal_helpers
import torch
from refusal_helpers import refused

from vcdask.trainable import check_trainable


class Counted(torch.nn.Module):
    def __init__(self, extra):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
        self.calls = 0
        self.extra = extra

    def forward(self, x):
        return self.lin(x)

    def get_extra_state(self):
        return self.extra(self.calls)

    def set_extra_state(self, state):
        self.calls = int(state["calls"] if isinstance(state, dict) else state)


class Outer(torch.nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.counter = Counted(extra)

    def forward(self, x):
        return self.counter(x)


@pytest.fixture(autouse=True)
def _synchronous(monkeypatch):
    """The stand-in client answers vcdask.cluster.check_sync's question (a synchronous client) and fails on any
    other attribute, as before that check came."""
    monkeypatch.setattr(refusal_helpers.NoCluster, "asynchronous", False, raising=False)


@pytest.fixture
def xy():
    X = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    return X, X.sum(1, keepdims=True)


@pytest.mark.parametrize(
    ("extra", "kind"),
    [(lambda calls: {"calls": calls}, "dict"), (lambda calls: calls, "int"), (lambda calls: str(calls), "str")],
    ids=["dict", "int", "str"],
)
def test_extra_state_that_is_no_tensor_is_refused_before_any_cluster_work(extra, kind, xy, tmp_path):
    refused(
        Outer(extra),
        xy,
        tmp_path,
        TypeError,
        f"counter._extra_state ({kind}), not a tensor (what get_extra_state() returns)",
        "Return a tensor from get_extra_state()",
        "keep that state outside the state_dict",
    )


def test_extra_state_as_a_tensor_is_taken():
    check_trainable(Outer(lambda calls: torch.tensor(calls)))  # (no error: a tensor a version can store)
    model = Outer(lambda calls: torch.tensor(calls))
    assert isinstance(model.state_dict()["counter._extra_state"], torch.Tensor)
