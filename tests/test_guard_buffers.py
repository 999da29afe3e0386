"""Robust merging and ``max_update_norm`` judge an update by its parameters, not its float buffers.

BatchNorm on raw features keeps running variances of 1e4 and more, and a task moves them by about 1%: by
far more than it moves the weights.  Counted in the pseudo-gradient, those moves made its norm and its
direction, so an honest update was clipped to nothing and an attack on the weights passed the screens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import vcdask
from vcdask.engine.guard import WARM, Guard, _deltas, _norm
from vcdask.engine.policy import check_update
from vcdask.params import flatten


def _task(weight_scale: float, seed: int, var: float = 1e4):
    """``(base, client)`` of a Linear + BatchNorm model whose task moved the weights by about 0.2 (times
    ``weight_scale``) and the running variance (``var``) by about 1%."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model[1].running_var.fill_(var)
    model[1].running_mean.fill_(50.0)
    base = flatten(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model[0].weight += weight_scale * 0.05 * torch.randn(4, 4, generator=g)
        model[1].running_var += 0.01 * var * (1 + 0.1 * torch.randn(4, generator=g))
        model[1].running_mean += 1.0
    return base, flatten(model)


def _guard(**options):
    return Guard(SimpleNamespace(resilience=vcdask.Resilience(**options)))


def test_clipping_leaves_an_honest_batchnorm_update_whole():
    base, client = _task(1.0, seed=1)
    weights_moved = float((client["0.weight"] - base["0.weight"]).norm())
    assert weights_moved < 0.5  # within the clip, though its running variance moved by 100
    guard = _guard(clip_update_norm=1.0)
    out, problem = guard.screen("v0", base, client, steps=10, shard=0)
    assert problem is None
    assert out.equal(client)
    assert list(guard.norms) == pytest.approx([_norm(_deltas(base, client))])
    assert guard.norms[0] < 1.0


def test_a_clipped_update_scales_its_parameters_and_keeps_its_buffers_as_sent():
    base, client = _task(40.0, seed=1)  # weights moved by about 8: clipped to 1
    out, problem = _guard(clip_update_norm=1.0).screen("v0", base, client, steps=10, shard=0)
    assert problem is None
    moved = {k: out[k] - base[k] for k in ("0.weight", "0.bias")}
    assert float(torch.cat([v.ravel() for v in moved.values()]).norm()) == pytest.approx(1.0, rel=1e-5)
    ratio = moved["0.weight"] / (client["0.weight"] - base["0.weight"])
    assert torch.allclose(ratio, ratio.flatten()[0].expand_as(ratio))  # same direction, shorter
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(out[name], client[name])


def test_a_scaled_attack_on_the_weights_is_rejected_whatever_the_running_statistics_do():
    guard = _guard(max_norm_ratio=3.0)
    for seed in range(2, 2 + WARM):  # honest updates merged, as the screen counts them: the reference is their median
        guard._accept(_norm(_deltas(*_task(1.0, seed))))
    base, hostile = _task(50.0, seed=9)
    _, problem = guard.screen("v1", base, hostile, steps=10, shard=0)
    assert problem is not None and problem[0] == "norm"


def test_a_sign_flipped_update_is_rejected_whatever_the_running_statistics_do():
    """The server's own step moves the running statistics the way the workers' do (the same data): counted,
    they made a sign-flipped update's cosine with it about 1."""
    base, own = _task(1.0, seed=1)
    _, honest = _task(1.0, seed=1)
    flipped = honest.clone()
    for name in ("0.weight", "0.bias"):
        flipped[name].copy_(2 * base[name] - honest[name])
    guard = _guard(min_cosine=0.0)
    guard._by_base["v0"] = {("own", 0): _deltas(base, own)}  # (instead of a spec's probe model)
    assert guard.screen("v0", base, honest, steps=10, shard=0)[1] is None
    _, problem = guard.screen("v0", base, flipped, steps=10, shard=0)
    assert problem is not None and problem[0] == "direction"


def test_max_update_norm_is_on_the_parameters():
    server, client = _task(1.0, seed=1)
    check = {"staleness": 0, "max_staleness": None}
    assert check_update(server, client, **check, max_norm=1.0) is None  # weights moved 0.2, variance 100
    server, client = _task(20.0, seed=1)  # weights moved by about 4
    problem = check_update(server, client, **check, max_norm=1.0)
    assert problem is not None and problem[0] == "norm"


def test_a_model_without_buffers_is_judged_as_before():
    base = flatten({"w": torch.tensor([1.0, 1.0, 1.0])})
    client = flatten({"w": torch.tensor([4.0, 5.0, 1.0])})
    assert _norm(_deltas(base, client)) == pytest.approx(5.0)
    problem = check_update(base, client, staleness=0, max_staleness=None, max_norm=4.9)
    assert problem is not None and "= 5 >" in problem[1]
