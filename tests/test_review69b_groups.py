"""An option given flat and in its group is refused when the group was given it at its default value too
(``lr=0.1`` with ``Training(lr=1e-3)`` trained at 0.1, silently); the groups stay equal, shown and pickled as
before."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch

import vcdask
from vcdask.groups import Merging, Stopping, Training, fold


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fold(Training, Training(lr=1e-3), lr=0.1), "lr=0.1 and training=Training(lr=0.001) both set lr"),
        (lambda: fold(Training, Training(None, 1e-3), lr=0.1), "both set lr"),  # given by position
        (
            lambda: fold(Merging, Merging(rule=None), merge="vc-asgd"),
            "merge='vc-asgd' and merging=Merging(rule=None) both set rule",
        ),
        (
            lambda: fold(Stopping, Stopping(validate_every="auto"), validate_every=2),
            "validate_every=2 and stopping=Stopping(validate_every='auto') both set validate_every",
        ),
    ],
)
def test_a_group_given_a_field_at_its_default_still_sets_it(call, message):
    with pytest.raises(TypeError) as info:
        call()
    assert message in str(info.value)


def test_fit_refuses_lr_flat_and_in_training_at_its_default(tmp_path):
    X, y = np.zeros((20, 2), "float32"), np.zeros(20, "int64")
    with pytest.raises(TypeError, match=r"lr=0\.1 and training=Training\(lr=0\.001\) both set lr: pass it once"):
        vcdask.fit(torch.nn.Linear(2, 2), (X, y), lr=0.1, training=Training(lr=1e-3), store=tmp_path / "s")
    assert not (tmp_path / "s").exists()  # refused before the store was made


def test_fields_the_group_was_not_given_still_take_the_flat_option():
    assert fold(Training, Training(batch_size=64), lr=0.1) == Training(lr=0.1, batch_size=64)
    # dataclasses.replace passes every field: those it copied at their defaults are not taken as given
    replaced = dataclasses.replace(Training(), batch_size=64)
    assert fold(Training, replaced, lr=0.1) == Training(lr=0.1, batch_size=64)
    with pytest.raises(TypeError, match="both set batch_size"):
        fold(Training, replaced, batch_size=16)


def test_what_a_group_was_given_is_kept_by_pickle_and_copy_and_changes_nothing_else():
    given = Training(lr=1e-3)
    assert given == Training() and hash(given) == hash(Training()) and repr(given) == repr(Training())
    assert [f.name for f in dataclasses.fields(Training)][:2] == ["optimizer", "lr"]  # no field added
    for again in (pickle.loads(pickle.dumps(given)), copy.copy(given), copy.deepcopy(given)):
        assert again == given
        with pytest.raises(TypeError, match="both set lr"):
            fold(Training, again, lr=0.1)
