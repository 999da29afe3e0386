"""The default step's pre-flight and non-finite numbers (``vcdask._forward_check.check_model``): a model whose
parameters hold NaN/inf is refused, naming them (it passed the whole pre-flight, and the run failed on the cluster
after ``no_worker_timeout``, blaming its workers), and so is a loss that is NaN in train mode on more rows too; a
NaN loss on the probe rows alone is not (a loss masked to other rows; a BatchNorm whose running variance an old
release spoiled gives NaN in eval mode only, and trains)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from refusal_helpers import refused

from vcdask.data import DataError
from vcdask.options import plan


@pytest.fixture
def xy():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 8)).astype("float32")
    return X, (X[:, 0] + X[:, 1] > 0).astype("int64")


def _net(*middle):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), *middle, torch.nn.ReLU(), torch.nn.Linear(16, 2))


def test_a_model_whose_parameters_hold_nan_is_refused_naming_them(xy, tmp_path):
    model = _net()
    with torch.no_grad():
        model[2].bias[1] = float("nan")
    refused(model, xy, tmp_path, DataError, "parameters hold non-finite values (NaN/inf) in ['2.bias']", "initialize")


def test_a_loss_nan_on_every_row_is_refused_naming_the_rows_tried(xy, tmp_path):
    """It ran: NaN gradients failed the run after no_worker_timeout (300 s), finite ones trained NaN silently."""

    def sqrt_of_negative(out, target):
        return torch.sqrt(-(out - out.detach()).abs().sum(1) - 1.0).mean()

    refused(_net(), xy, tmp_path, DataError, "the loss of the model's outputs is nan", "more rows across it too",
            loss=sqrt_of_negative)  # fmt: skip


def test_a_nan_loss_on_the_probe_rows_alone_is_not_refused(xy, tmp_path):
    """The probe rows are the data's first (before any shuffle): a loss over some rows only (here the positives) is
    a mean over none there."""
    X, y = xy
    y = y.copy()
    y[:8] = 0

    def positives(out, target):
        chosen = target == 1
        return F.cross_entropy(out[chosen], target[chosen])

    assert torch.isnan(positives(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)))
    assert plan(_net(), (X, y), store=tmp_path / "a", loss=positives).train.n == 60


def test_a_batchnorm_spoiled_for_eval_mode_only_is_not_refused(xy, tmp_path):
    """A negative running variance (written by releases before the merge stopped extrapolating buffers): the eval
    forward of the probe gives NaN, training (batch statistics) does not, and the nightly job that starts from such
    a release trains on as it did."""
    model = _net(torch.nn.BatchNorm1d(16))
    with torch.no_grad():
        model[1].running_var[:4] = -0.2
    model.eval()
    assert not torch.isfinite(model(torch.as_tensor(xy[0][:4]))).all()
    model.train()
    assert plan(model, xy, store=tmp_path / "a").train.n == 60
