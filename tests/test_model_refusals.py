"""Models vcdask cannot train as given are refused before any cluster work, naming what is at fault and the
remedy (``vcdask.trainable``): every parameter frozen, a state of a dtype no version can store."""

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


class _Complex(torch.nn.Module):
    """A complex weight (or, with ``buffer=True``, a complex buffer beside a real layer)."""

    def __init__(self, buffer=False):
        super().__init__()
        torch.manual_seed(0)
        self.l = torch.nn.Linear(6, 3)
        w = torch.randn(6, 3, dtype=torch.cfloat)
        if buffer:
            self.register_buffer("w", w)
        else:
            self.w = torch.nn.Parameter(w)

    def forward(self, x):
        return self.l(x) + (x.to(torch.cfloat) @ self.w).abs()


@pytest.mark.parametrize("buffer", [False, True], ids=["parameter", "buffer"])
def test_a_complex_state_is_refused_before_any_cluster_work(buffer, xy, tmp_path):
    """Else staging and the cluster's start come first, and the first commit fails ('cannot store parameters of
    dtype torch.complex64')."""
    _refused(
        _Complex(buffer),
        xy,
        tmp_path,
        TypeError,
        "the model holds w (complex64) of a dtype vcdask cannot store",
        "'float32'",
        "torch.view_as_real(w)",
        "torch.view_as_complex(self.w)",
    )


def test_a_float64_model_is_taken(xy, tmp_path):
    from vcdask.options import plan

    X, y = xy
    assert plan(_mlp().double(), (X.astype("float64"), y), store=tmp_path / "s").x_dtype == torch.float64
