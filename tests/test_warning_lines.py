"""vcdask's warnings point at the user's line, however deep in vcdask they are raised and however many frames
lie between (``fit``'s keyword check is a decorator: with fixed ``stacklevel``s, its warnings pointed into
vcdask/_keywords.py).  Real fits on a threaded cluster."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vcdask


def _data() -> tuple[np.ndarray, np.ndarray]:
    X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    return X, (X[:, 0] > 0).astype("int64")


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _said(record, text: str):
    [warning] = [w for w in record if text in str(w.message)]
    return warning


def test_a_head_only_optimizer_is_said_at_the_fit_call(threaded_client, tmp_path):
    head_only = lambda params: torch.optim.SGD(params[-2:], lr=0.1)  # noqa: E731
    with pytest.warns(UserWarning) as record:
        vcdask.fit(
            _net(),
            _data(),
            optimizer=head_only,
            client=threaded_client,
            store=tmp_path / "s",
            max_epochs=1,
            progress=False,
        )
    assert _said(record, "get gradients but no step").filename == __file__


def test_a_metric_that_fails_on_the_checks_few_rows_is_said_at_the_fit_call(threaded_client, tmp_path):
    def picky(outputs, labels):
        if len(labels) < 10:
            raise ValueError("needs 10 rows")
        return float((outputs.argmax(1) == labels).float().mean())

    with pytest.warns(UserWarning) as record:
        vcdask.fit(
            _net(),
            _data(),
            validation=0.25,
            metrics={"picky": picky},
            batch_size=32,
            client=threaded_client,
            store=tmp_path / "s",
            max_epochs=1,
            progress=False,
        )
    assert _said(record, "on these").filename == __file__
