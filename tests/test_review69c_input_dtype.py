"""The dtype floating inputs take is the one most of the model's parameters hold (``preflight.model_dtype``), not
the first parameter's: a float64 scalar on the root module (a learned temperature) beside float32 layers, which
plain torch trains, made vcdask feed float64 inputs and refuse the model ('mat1 and mat2 must have the same dtype')
with a message naming the data's float32 only."""

from __future__ import annotations

import numpy as np
import pytest
import refusal_helpers
import torch
from refusal_helpers import refused

from vcdask.errors import DataError
from vcdask.options import plan
from vcdask.preflight import model_dtype


class Tempered(torch.nn.Module):
    def __init__(self, shape=()):
        super().__init__()
        torch.manual_seed(0)
        self.log_temp = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))  # (first in parameters())
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x):
        scale = self.log_temp.exp().float() if self.log_temp.numel() else 1.0
        return self.net(x) * scale


@pytest.fixture(autouse=True)
def _synchronous(monkeypatch):
    """The stand-in client answers vcdask.cluster.check_sync's question (a synchronous client) and fails on any
    other attribute, as before that check came."""
    monkeypatch.setattr(refusal_helpers.NoCluster, "asynchronous", False, raising=False)


@pytest.fixture
def xy():
    X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    return X, (X @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32"))[:, None]


@pytest.mark.parametrize("shape", [(), (0,)], ids=["scalar", "empty"])
def test_a_float64_root_parameter_beside_float32_layers_gives_float32_inputs(shape, xy, tmp_path):
    model = Tempered(shape)
    assert model_dtype(model) == torch.float32
    planned = plan(model, xy, store=tmp_path / "s")
    assert planned.x_dtype == torch.float32  # (RunSpec.x_dtype: the workers cast their batches to it)


def test_model_dtype_follows_most_elements_and_the_default_without_floats():
    assert model_dtype(torch.nn.Linear(4, 2).double()) == torch.float64
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 1).double(), torch.nn.Linear(8, 8))  # 3 float64, 72 float32
    assert model_dtype(mixed) == torch.float32
    assert model_dtype(torch.nn.Sequential(torch.nn.Linear(8, 8).double(), torch.nn.Linear(2, 1))) == torch.float64
    tie = torch.nn.Sequential(torch.nn.Linear(1, 1).double(), torch.nn.Linear(1, 1))
    assert model_dtype(tie) == torch.float64  # (a tie: the first)


def test_the_refusal_names_the_dtype_the_model_was_fed(xy, tmp_path):
    """A float64 model that cannot take float32 rows... as fed: float64, the dtype vcdask casts them to."""

    class Strict(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1).double()

        def forward(self, x):
            return self.lin(x.reshape(3, -1))  # (fails: the rows do not have 3 x k values)

    refused(
        Strict(),
        xy,
        tmp_path,
        DataError,
        "samples of shape (4,) and dtype float32, fed to the model as float64 (the dtype of most of its parameters)",
    )


def test_the_model_trains_as_plain_torch_does(xy, tmp_path):
    from distributed import Client, LocalCluster

    import vcdask

    model, initial = Tempered(), Tempered()
    before = model.net.weight.detach().clone()
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        result = vcdask.fit(
            model, xy, client=client, store=tmp_path / "store", max_epochs=2, n_shards=2, progress=False, lr=0.05
        )
    trained = result.model
    assert trained.log_temp.dtype == torch.float64 and float(trained.log_temp.detach()) != 0.0  # (it trained)
    assert not torch.equal(trained.net.weight.detach(), before)
    X, y = map(torch.as_tensor, xy)
    with torch.no_grad():
        assert torch.nn.functional.mse_loss(trained(X), y) < torch.nn.functional.mse_loss(initial(X), y)
        expected = trained(X).numpy()
    np.testing.assert_allclose(result.predict(xy[0]), expected, rtol=1e-6)  # (fed float32, as in training)
    np.testing.assert_allclose(result.predict(xy[0].astype("float64")), expected, rtol=1e-6)
