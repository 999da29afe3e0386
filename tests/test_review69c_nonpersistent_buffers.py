"""A non-persistent buffer (``persistent=False``) that the forward pass changes in train mode is said before the
run: vcdask merges and returns ``state_dict()``, which leaves it out, so it stayed at its initial value in
``result.model`` silently (plain torch: seen=192; result.model.seen=0)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from vcdask import preflight
from vcdask.data import prepare_data


class Seen(torch.nn.Module):
    def __init__(self, persistent=False, counts=True):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
        self.counts = counts
        self.register_buffer("seen", torch.zeros((), dtype=torch.long), persistent=persistent)
        self.register_buffer("cache", torch.arange(4.0), persistent=False)  # (read, never changed)

    def forward(self, x):
        if self.training and self.counts:
            self.seen += len(x)
        return self.lin(x + self.cache)


class Outer(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.body = Seen(**kw)

    def forward(self, x):
        return self.body(x)


@pytest.fixture
def xy():
    X = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    return X, X.sum(1, keepdims=True)


def test_a_nonpersistent_buffer_changed_in_train_mode_is_said_by_fit(xy, tmp_path):
    from distributed import Client, LocalCluster

    import vcdask

    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
        pytest.warns(UserWarning) as record,
    ):
        result = vcdask.fit(Outer(), xy, client=client, store=tmp_path / "s", max_epochs=1, progress=False)
    said = [w for w in record if "non-persistent" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in record]
    message = str(said[0].message)
    assert message.startswith("the model's non-persistent buffer body.seen (registered with persistent=False)")
    assert "body.cache" not in message
    assert "neither merged nor returned (result.model keeps the values given to fit)" in message
    assert "self.register_buffer(name, tensor) (persistent=True, the default)" in message
    assert said[0].filename == __file__  # (said at fit's caller)
    assert int(result.model.body.seen) == 0  # (what the warning says: the workers' counts are not returned)


def test_a_train_step_that_changes_one_is_said_too(xy):
    X, y = xy
    prepared = prepare_data({"X": X, "y": y}, batches="dict")
    with pytest.warns(UserWarning, match="non-persistent buffer body.seen"):
        preflight.check_nonpersistent_buffers(
            Outer(), prepared, train_step=lambda m, b: torch.nn.functional.mse_loss(m(b["X"]), b["y"])
        )


@pytest.mark.parametrize("kw", [{"persistent": True}, {"counts": False}], ids=["persistent", "nonpersistent-unchanged"])
def test_buffers_that_are_kept_or_unchanged_are_not_said(kw, xy):
    model = Outer(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preflight.check_nonpersistent_buffers(model, prepare_data(xy))
    assert int(model.body.seen) == 0  # (the pass ran on a copy)


def test_a_cache_resized_to_the_inputs_is_not_said(xy):
    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
            self.register_buffer("positions", torch.arange(2), persistent=False)

        def forward(self, x):
            if len(self.positions) != len(x):
                self.positions = torch.arange(len(x))
            return self.lin(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preflight.check_nonpersistent_buffers(Cached(), prepare_data(xy))
