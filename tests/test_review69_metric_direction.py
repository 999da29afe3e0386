"""A metric given as a functools.partial is named with its arguments ("scaled_error(scale=1.0)"), and the one rule
of a metric's direction (engine.policy.lower_is_better) read the end of that name, ")": no partial improved
downwards, a target of an error was "reached" at any larger error and patience kept the worst epoch."""

from __future__ import annotations

import functools

import pytest
import torch

from vcdask.engine import policy
from vcdask.engine.events import EventLog
from vcdask.engine.ledger import Ledger
from vcdask.metrics import metric_name


class _Scheduler:
    def log_event(self, topic, msg):
        pass


def scaled_error(out, target, scale=1.0):
    return float((out - target).abs().mean() * scale)


def topk_accuracy(out, target, k=1):
    return float((out.topk(k, dim=-1).indices == target[:, None]).any(dim=1).float().mean())


@pytest.mark.parametrize(
    ("fn", "name", "lower"),
    [
        (functools.partial(scaled_error, scale=1.0), "scaled_error(scale=1.0)", True),
        (functools.partial(torch.nn.functional.l1_loss, reduction="mean"), "l1_loss(reduction='mean')", True),
        # a partial of a partial (functools flattens it), arguments holding parentheses: the function's name is read
        (
            functools.partial(functools.partial(scaled_error, scale=(1, 2)), target=")"),
            "scaled_error(scale=(1, 2), target=')')",
            True,
        ),
        (functools.partial(topk_accuracy, k=3), "topk_accuracy(k=3)", False),
    ],
)
def test_a_partial_metric_improves_in_its_functions_direction(fn, name, lower):
    assert metric_name(fn) == name
    assert policy.lower_is_better(name) is lower
    assert policy.improved(name, 1.0, 2.0) is lower and policy.improved(name, 2.0, 1.0) is not lower
    assert policy.reached(name, 0.05, 2.14) is not lower  # an error of 2.14 does not reach 0.05
    assert policy.reached(name, 0.05, 0.04) is lower


def test_target_and_patience_of_a_partial_error_follow_it_downwards():
    """The reviewer's run: target={"scaled_error(scale=1.0)": 0.05} was reached at 2.14 (epoch 1) and patience
    kept the worst epoch; the target is not reached, and the best epoch is the lowest error's."""
    name = metric_name(functools.partial(scaled_error, scale=1.0))
    events = EventLog(_Scheduler(), "r")
    ledger = Ledger(1, 10, validated=True, target={name: 0.05}, events=events, patience=2, monitor=name)
    stop = None
    for epoch, value in enumerate([2.14, 1.0, 1.5, 1.2, 0.9], start=1):
        ledger.record(epoch, 0, 0, "merged", accepted=True, train_loss=1.0, new_version=epoch)
        ledger.note_merged(epoch, 0, seconds=1.0, step=epoch)
        ledger.validate(epoch, {name: value})
        stop = ledger.close_epochs()
        if stop is not None:
            break
    assert epoch == 4
    assert stop == f"early stopping: {name} has not improved for 2 epochs (best 1 at epoch 2)"
    assert ledger.best == {"epoch": 2, "step": 2, "value": 1.0}
