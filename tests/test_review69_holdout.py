"""monitor= with a target= and no validation= (nor patience=) was refused for want of validation data, though a
target holds out 10% of the data by itself: the monitor follows that held-out part."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vcdask import Stopping
from vcdask.holdout import HOLD_OUT, hold_out
from vcdask.options import plan


def test_a_monitor_with_a_target_follows_the_data_the_target_holds_out(tmp_path):
    assert hold_out(None, target={"accuracy": 0.9}, patience=None, monitor="loss") == HOLD_OUT
    X = np.random.default_rng(0).normal(size=(50, 3)).astype("float32")
    y = (X[:, 0] > 0).astype("int64")
    stopping = Stopping(target={"accuracy": 0.9}, monitor="loss")
    planned = plan(torch.nn.Linear(3, 2), (X, y), stopping=stopping, store=tmp_path / "s")
    assert planned.validation is not None and planned.validation.n == 5  # (10% of 50 held out)
    assert planned.stopping.monitor == "loss" and planned.stopping.target == {"accuracy": 0.9}


def test_a_monitor_without_any_validation_is_refused_naming_the_three_ways_to_get_some():
    with pytest.raises(ValueError, match=r"monitor='loss' follows a validation metric") as refused:
        hold_out(None, target=None, patience=None, monitor="loss")
    assert all(way in str(refused.value) for way in ("validation=", "patience=", "target="))
