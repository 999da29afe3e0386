"""Mistakes of a first hour with vcdask, each refused by ``fit`` before any cluster or store work, with a message
that names the cause and the remedy (through the real ``fit`` path: :func:`refusal_helpers.refused`)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from refusal_helpers import refused

from vcdask.errors import DataError

N = 64


@pytest.fixture
def X():
    return np.random.default_rng(0).normal(size=(N, 8)).astype("float32")


def _linear(n_out=1):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, n_out))


@pytest.mark.parametrize(
    ("loss", "shown"),
    [
        (torch.nn.MSELoss(), "loss=torch.nn.MSELoss()"),
        (torch.nn.L1Loss(reduction="sum"), "loss=torch.nn.L1Loss(reduction='sum')"),
        (torch.nn.HuberLoss(), "loss=torch.nn.HuberLoss()"),
        (torch.nn.SmoothL1Loss(), "loss=torch.nn.SmoothL1Loss()"),
        (functools.partial(torch.nn.functional.huber_loss, delta=2.0), "loss=torch.nn.functional.huber_loss"),
    ],
)
def test_elementwise_loss_modules_that_would_broadcast_are_refused(X, tmp_path, loss, shown):
    y = np.random.default_rng(1).normal(size=N).astype("float32")  # (n,) labels against (n, 1) outputs
    refused(
        _linear(1),
        (X, y),
        tmp_path,
        DataError,
        shown,
        "would compare model outputs of shape (n, 1) with labels of shape (n,) by broadcasting them to (n, n)",
        "y.reshape(-1, 1)",
        loss=loss,
    )
