"""The inner optimizer as fit takes it (vcdask.optimizers): ``lr=`` applied or refused, and the optimizer built on
the model's copy as each worker builds it, refused before any cluster work when it would train nothing or fail
there."""

from __future__ import annotations

import functools
import types
import warnings

import numpy as np
import pytest
import torch
from refusal_helpers import refused

from vcdask import inner
from vcdask.device import Precision
from vcdask.optimizers import check_inner_optimizer, resolve_optimizer


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    return rng.random((40, 4), dtype=np.float32), rng.integers(0, 3, 40)


def _no_decay_on_biases(params):
    """The usual recipe, written against ``params``: two passes over it."""
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.05},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )


def test_a_factory_that_reads_params_twice_gets_every_parameter_on_the_worker():
    """``params`` was ``model.parameters()``, a generator: the second group came out empty and the biases never
    trained."""
    spec = types.SimpleNamespace(
        run_id="r-groups", optimizer=_no_decay_on_biases, optimizer_state="fresh", lr_schedule=None, clip_grad_norm=None
    )
    model = _net()
    opt = inner.InnerOptimizer(spec, model, Precision("32", torch.device("cpu")), 1)
    weights, biases = opt.optimizer.param_groups
    assert [p.shape for p in weights["params"]] == [(8, 4), (3, 8)]
    assert [p.shape for p in biases["params"]] == [(8,), (3,)]
    check_inner_optimizer(_no_decay_on_biases, model, given=_no_decay_on_biases, lr=1e-3)  # and the check passes it


def test_an_optimizer_over_the_callers_model_is_refused_naming_its_parameters(data, tmp_path):
    """torch's idiom for groups refers to the model's submodules; each worker builds the optimizer on its copy,
    so an optimizer over the caller's own parameters trained nothing there, silently."""
    model = _net()

    def per_layer(params):
        return torch.optim.AdamW(
            [{"params": model[0].parameters(), "lr": 1e-2}, {"params": model[2].parameters(), "lr": 1e-3}]
        )

    message = refused(
        model,
        data,
        tmp_path,
        ValueError,
        "optimizer=per_layer: the optimizer holds 4 parameters",
        "holds 4 parameters that are not those it was given: your model's 0.weight, 0.bias, 2.weight, 2.bias "
        "(a closure over your model?)",
        "trains only what it holds, so 4 trainable parameters are in no group of the optimizer",
        "build the groups from the params argument",
        "model.named_parameters() order (0.weight, 0.bias, 2.weight, 2.bias)",
        optimizer=per_layer,
    )
    assert "params[i:j]" in message


def test_trainable_parameters_in_no_group_are_said_and_frozen_ones_may_stay_out():
    """Fine-tuning the head only (``SGD(params[-2:])``) is torch's own idiom: it was refused, and worked before."""
    head_only = lambda params: torch.optim.SGD(params[-2:], lr=0.1)  # noqa: E731
    with pytest.warns(UserWarning) as warned:
        check_inner_optimizer(head_only, _net(), given=head_only, lr=1e-3)
    [message] = [str(w.message) for w in warned]
    assert "optimizer=<lambda>: 2 trainable parameters are in no group of the optimizer (0.weight, 0.bias)" in message
    assert "they get gradients but no step" in message and "requires_grad_(False)" in message
    model = _net()
    model[0].requires_grad_(False)  # frozen: outside the optimizer is where they belong, and nothing is said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_inner_optimizer(head_only, model, given=head_only, lr=1e-3)


@pytest.mark.parametrize(
    ("optimizer", "error", "fragment"),
    [
        (torch.optim.LBFGS, ValueError, "LBFGS.step needs a closure"),
        (lambda _params: "sgd", TypeError, "must make a torch.optim.Optimizer from the params it is given, got str"),
        (lambda params: torch.optim.SGD(params, lr=-1.0), ValueError, "cannot be made from the model's parameters"),
    ],
)
def test_an_optimizer_that_would_fail_on_the_workers_is_refused(data, tmp_path, optimizer, error, fragment):
    refused(_net(), data, tmp_path, error, fragment, optimizer=optimizer)


def test_lr_reaches_a_partial_of_an_optimizer_class():
    """``lr=`` was applied to a class only: a partial trained at torch's default rate, whatever lr said."""
    sgd = functools.partial(torch.optim.SGD, momentum=0.9)
    made = resolve_optimizer(sgd, 0.1)(list(_net().parameters()))
    assert made.param_groups[0]["lr"] == 0.1 and made.param_groups[0]["momentum"] == 0.9
    own = functools.partial(torch.optim.SGD, lr=0.05)
    assert resolve_optimizer(own, 1e-3)(list(_net().parameters())).param_groups[0]["lr"] == 0.05  # lr= unset
    assert resolve_optimizer(own, 0.05) is own  # the same rate, twice


def test_two_learning_rates_or_one_a_factory_ignores_are_refused(data, tmp_path):
    refused(
        _net(),
        data,
        tmp_path,
        ValueError,
        "lr=0.1 and optimizer=functools.partial(torch.optim.SGD, lr=0.05) both set the learning rate",
        optimizer=functools.partial(torch.optim.SGD, lr=0.05),
        lr=0.1,
    )
    refused(
        _net(),
        data,
        tmp_path,
        ValueError,
        "lr=0.1 cannot be applied to optimizer=<lambda>, a function that makes its optimizer with its own "
        "learning rate (0.01)",
        "optimizer=torch.optim.AdamW, lr=...",
        optimizer=lambda params: torch.optim.AdamW(params, lr=0.01),
        lr=0.1,
    )
    # the function's own rate is lr's: nothing is lost
    check_inner_optimizer(lambda params: torch.optim.SGD(params, lr=0.1), _net(), given=lambda _p: None, lr=0.1)


@pytest.mark.parametrize(
    "make",
    [
        # a base rate beside a group's own: lr= is the base's
        lambda params: torch.optim.AdamW([{"params": params[:2], "lr": 1e-4}, {"params": params[2:]}], lr=3e-4),
        lambda params: torch.optim.Adam(params, lr=torch.tensor(3e-4)),  # 3e-4 as float32 holds it
    ],
)
def test_an_lr_that_one_of_the_factorys_groups_uses_is_taken(make):
    """Both were refused: the check wanted lr= to be every group's rate, exactly."""
    check_inner_optimizer(make, _net(), given=make, lr=3e-4)
