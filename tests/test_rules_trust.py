"""``bias_correction="trust"`` does what the merge-rules guide and ``Nesterov``'s docstring say.

Its bound is measured on ``|W_s|`` as the momentum step starts (``delay=1``: before the arrival's step, which
is one with the momentum step; ``delay=N``: after the closing arrival's share), and a cut weighs the cosine in
by the share of the correction it cut (``w``), not all the way as ``"agreement"`` does.
"""

from __future__ import annotations

import math

import pytest
import torch

from vcdask.merge import Arrival, Nesterov
from vcdask.params import flatten

LR, MU = 0.5, 0.9


def _flat(*values):
    return flatten({"w": torch.tensor(values, dtype=torch.float64)})


def _momentum_gain(before, after, g, m):
    """The gain of a momentum step that took ``W_s`` from ``before`` to ``after`` (``delay=1``), with
    pseudo-gradient ``g`` and momentum ``m`` after the step."""
    return float(((before - after) / LR - g)[0] / (MU * m[0]))


def test_with_delay_1_the_bound_is_on_w_s_before_the_arrivals_step():
    rule = Nesterov(lr=LR, momentum=MU, delay=1)  # "trust"
    server = _flat(3.0, 4.0)  # |W_s| = 5 before the step
    state = rule.init_state(server)
    g = torch.tensor([2.0, 0.0], dtype=torch.float64)
    rule.apply(server, _flat(1.0, 4.0), state, Arrival(epoch=1))
    gain = _momentum_gain(torch.tensor([3.0, 4.0], dtype=torch.float64), server.arrays["float64"], g, g)
    assert gain == pytest.approx(0.5 * 5.0 / (LR * MU * 2.0))  # 2.78 < Adam's 10: cut, on the pre-step |W_s|
    assert state.scalars["bounded"] == pytest.approx((10 - gain) / 9)


def test_with_a_delay_the_bound_is_on_w_s_after_the_closing_arrivals_share():
    rule = Nesterov(lr=LR, momentum=MU, delay=2)
    server = _flat(3.0, 4.0)
    state = rule.init_state(server)
    rule.apply(server, _flat(1.0, 4.0), state, Arrival(epoch=1))  # g = (2, 0): W_s moves by its share lr * g / 2
    rule.apply(server, _flat(0.5, 4.0), state, Arrival(epoch=1))  # g = (2.5 - 0.5, 0), closing the window
    shares = torch.tensor([3.0 - LR * 2.0 / 2, 4.0], dtype=torch.float64)  # after the first share
    g2 = shares[0] - 0.5
    shares[0] -= LR * g2 / 2  # after the closing arrival's share: the |W_s| the bound is on
    m = (2.0 + g2) / 2  # the window's mean pseudo-gradient
    room = 0.5 * float(shares.norm())
    gain = (shares[0] - server.arrays["float64"][0]) / (LR * MU * m)
    assert float(gain) == pytest.approx(room / (LR * MU * m))


def test_trust_weighs_the_cosine_by_the_share_of_the_correction_the_bound_cut():
    """After the same first step, whose correction the bound cut by ``w``, a second window at an angle to the
    momentum is corrected by ``1 + (full - 1) (1 - w (1 - cos))`` under "trust", by the cosine alone under
    "agreement"."""
    gains = {}
    for correction in ("trust", "agreement"):
        rule = Nesterov(lr=LR, momentum=MU, delay=1, bias_correction=correction)
        server = _flat(30.0, 400.0)  # |W_s| = 401: room 200
        state = rule.init_state(server)
        rule.apply(server, _flat(-70.0, 400.0), state, Arrival(epoch=1))  # g = (100, 0): Adam's 10 cut to 4.45
        before = server.arrays["float64"].clone()  # (-220, 400): the second step's bound (5.6) does not cut
        g = torch.tensor([1.0, 1.0], dtype=torch.float64)  # cosine 0.707 with the momentum (100, 0)
        m_before = state.arrays["momentum"].arrays["float64"].clone()
        rule.apply(server, _flat(*(before - g).tolist()), state, Arrival(epoch=1))
        m = MU * m_before + g
        step = (before - server.arrays["float64"]) / LR - g
        gains[correction] = float(step[1] / (MU * m[1]))
        gains[correction + " w"] = float(state.scalars.get("bounded", 1.0))
    full = 1 / (1 - MU**2)
    cosine = 1 / math.sqrt(2)
    w = gains["trust w"]
    assert 0 < w < 1  # the first step was cut in part
    assert gains["trust"] == pytest.approx(1 + (full - 1) * (1 - w * (1 - cosine)), rel=1e-6)
    assert gains["agreement"] == pytest.approx(1 + (full - 1) * cosine, rel=1e-6)
    assert gains["trust"] > gains["agreement"]
