"""A state of a dtype no version can store is refused with a remedy for that dtype (uint16 and uint32 buffers, float8
ones, were told to use view_as_real, the complex numbers' remedy); a float16 / bfloat16 buffer beside float32
parameters is taken (it is not trained; it was refused as a "float16 parameter"), and half-precision parameters are
refused as before, naming the parameters only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

import vcdask
from vcdask.options import plan
from vcdask.preflight import check_model_precision
from vcdask.trainable import check_trainable


def _with_buffer(dtype, value=0.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 1))
    model.register_buffer("table", torch.full((3,), value).to(dtype))
    return model


@pytest.mark.parametrize(
    ("dtype", "remedy"),
    [
        (torch.uint16, "Keep a uint16 tensor as int32 (t.to(torch.int32), which holds its values)"),
        (torch.uint32, "Keep a uint32 tensor as int64 (t.to(torch.int64), which holds its values)"),
        (torch.float8_e4m3fn, "Keep a float8_e4m3fn tensor in float32 (t.float())"),
        (torch.complex64, "torch.nn.Parameter(torch.view_as_real(w))"),
    ],
    ids=["uint16", "uint32", "float8", "complex64"],
)
def test_each_unstorable_dtype_gets_its_own_remedy(dtype, remedy):
    with pytest.raises(TypeError) as info:
        check_trainable(_with_buffer(dtype))
    message = str(info.value)
    name = str(dtype).removeprefix("torch.")
    assert message.startswith(f"the model holds table ({name}) of a dtype vcdask cannot store in a version")
    assert remedy in message
    assert ("view_as_real" in message) == dtype.is_complex


def test_two_dtypes_get_both_remedies():
    model = _with_buffer(torch.uint16)
    model.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError) as info:
        check_trainable(model)
    assert "table (uint16), phase (complex64)" in str(info.value)
    assert "as int32" in str(info.value) and "view_as_real" in str(info.value)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_a_half_precision_buffer_beside_float32_parameters_is_taken_and_trains(half, tmp_path):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 1)
            self.register_buffer("scale", torch.tensor(2.0, dtype=half))

        def forward(self, x):
            return self.lin(x) * self.scale.float()

    check_model_precision(Scaled())  # (no error)
    X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (X @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32"))[:, None]
    assert plan(Scaled(), (X, y), store=tmp_path / "p").x_dtype == torch.float32
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        result = vcdask.fit(
            Scaled(), (X, y), client=client, store=tmp_path / "s", max_epochs=2, n_shards=2, progress=False, lr=0.05
        )
    trained, initial = result.model, Scaled()
    assert trained.scale.dtype == half and float(trained.scale) == 2.0
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    with torch.no_grad():
        assert torch.nn.functional.mse_loss(trained(Xt), yt) < torch.nn.functional.mse_loss(initial(Xt), yt)


def test_half_precision_parameters_are_refused_naming_the_parameters_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(2)).half()
    with pytest.raises(ValueError) as info:
        check_model_precision(model)
    message = str(info.value)
    assert message.startswith("the model holds float16 parameters (0.weight, 0.bias, 1.weight and 1 more)")
    assert "running_mean" not in message
