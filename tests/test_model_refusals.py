"""Models vcdask cannot train as given are refused before any cluster work, naming what is at fault and the
remedy (``vcdask.trainable``): every parameter frozen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vcdask


class NoCluster:
    """A client stand-in that fails the test if fit ever reaches for the cluster."""

    scheduler_address = "tcp://127.0.0.1:1"

    def __getattr__(self, name):
        raise AssertionError(f"fit touched the cluster ({name}) before rejecting its input")


def _refused(model, data, tmp_path, exc, *fragments, **kwargs) -> str:
    """fit refuses ``model`` before touching the cluster or the store; its message holds every fragment."""
    store = tmp_path / "store"
    with pytest.raises(exc) as info:
        vcdask.fit(model, data, client=NoCluster(), store=store, progress=False, **kwargs)
    assert not store.exists(), "the store was created before the model was rejected"
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


@pytest.fixture
def xy():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 6)).astype("float32")
    return X, X[:, :3].argmax(1).astype("int64")


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("step", [False, True], ids=["default-step", "train_step"])
def test_a_model_with_every_parameter_frozen_is_refused(step, xy, tmp_path):
    """Else every task fails on the cluster: 'element 0 of tensors does not require grad'."""
    model = _mlp().requires_grad_(False)
    kwargs = {"train_step": lambda m, b: torch.nn.functional.cross_entropy(m(b["X"]), b["y"])} if step else {}
    X, y = xy
    _refused(
        model,
        {"X": X, "y": y} if step else (X, y),
        tmp_path,
        ValueError,
        "no parameter of the model requires grad",
        "all 4 are frozen",
        "0 (Linear: weight, bias), 2 (Linear: weight, bias)",
        "model.requires_grad_(True)",
        **kwargs,
    )


def test_a_partly_frozen_model_is_taken(xy, tmp_path):
    """Fine-tuning a head over a frozen body is a run like any other."""
    from vcdask.options import plan

    model = _mlp()
    model[0].requires_grad_(False)
    planned = plan(model, xy, store=tmp_path / "s")
    assert planned.model is model and [p.requires_grad for p in model.parameters()] == [False, False, True, True]
