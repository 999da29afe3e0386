"""Merge rules and alpha schedules against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from vcdask.errors import ParameterMismatchError
from vcdask.merge import vc_asgd
from vcdask.params import flatten
from vcdask.schedules import EpochSchedule, UnknownScheduleError, get_schedule


def _pair():
    server = flatten({"w": torch.tensor([0.0, 1.0, -2.0, 4.0]), "n": torch.tensor(3)})
    client = flatten({"w": torch.tensor([1.0, 1.0, 2.0, 0.0]), "n": torch.tensor(7)})
    return server, client


@pytest.mark.parametrize(
    ("alpha", "expected"),
    [
        (0.0, [1.0, 1.0, 2.0, 0.0]),  # the client's copy
        (0.5, [0.5, 1.0, 0.0, 2.0]),
        (0.95, [0.05, 1.0, -1.8, 3.8]),  # 0.95 * s + 0.05 * c
        (1.0, [0.0, 1.0, -2.0, 4.0]),  # the server's copy
    ],
)
def test_vc_asgd_hand_computed(alpha, expected):
    server, client = _pair()
    before = client.clone()
    out = vc_asgd(server, client, alpha)
    assert out is server  # in place
    torch.testing.assert_close(server.state_dict()["w"], torch.tensor(expected), rtol=0, atol=1e-6)
    assert server.state_dict()["n"].item() == 7  # integer state takes the client's value
    assert client.equal(before)  # the client copy is untouched


def test_vc_asgd_sequence_matches_equation_2():
    """n_t merges with constant alpha: W = alpha^n W0 + (1 - alpha) sum_j alpha^(n-j) W_j (the paper's eq. 2)."""
    alpha = 0.7
    server = flatten({"w": torch.tensor([1.0, -1.0])})
    clients = [torch.tensor([2.0, 0.0]), torch.tensor([0.0, 4.0]), torch.tensor([-1.0, 1.0])]
    for c in clients:
        vc_asgd(server, flatten({"w": c}), alpha)
    n = len(clients)
    expected = alpha**n * torch.tensor([1.0, -1.0]) + (1 - alpha) * sum(
        alpha ** (n - 1 - j) * c for j, c in enumerate(clients)
    )
    torch.testing.assert_close(server.arrays["float32"], expected, rtol=0, atol=1e-6)


def test_vc_asgd_rejects_other_layout():
    server, _ = _pair()
    other = flatten({"w": torch.zeros(5), "n": torch.tensor(1)})
    with pytest.raises(ParameterMismatchError, match=r"w: shape \[5\] != expected \[4\]"):
        vc_asgd(server, other, 0.5)


def test_epoch_schedule_values():
    s = get_schedule("epoch")
    assert isinstance(s, EpochSchedule)
    assert [s(e) for e in (1, 2, 3, 39)] == [1 / 2, 2 / 3, 3 / 4, 39 / 40]


def test_constant_and_callable_schedules():
    assert get_schedule(0.95)(7) == 0.95
    assert get_schedule(lambda e: 1 - 1 / (e + 1))(3) == 0.75
    with pytest.raises(ValueError, match=r"at epoch 2.*\[0, 1\], got 2"):
        get_schedule(lambda e: e)(2)


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan, float("inf")])
def test_bad_alpha(bad):
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\], got"):
        get_schedule(bad)


def test_unknown_schedule_lists_names():
    with pytest.raises(UnknownScheduleError, match=r"unknown alpha schedule 'epochs'; available: \['epoch'\]"):
        get_schedule("epochs")
    with pytest.raises(ValueError):
        get_schedule("cosine")
