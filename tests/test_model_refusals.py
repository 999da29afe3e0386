"""Models vcdask cannot train as given are refused before any cluster work, naming what is at fault and the
remedy (``vcdask.trainable``): every parameter frozen, a state of a dtype no version can store, a model that
cannot be sent to the workers (``torch.nn.utils.parametrize``) or copied (the older ``weight_norm``), outputs
the default step cannot train on (a tuple, a dict)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from refusal_helpers import refused as _refused
from torch.nn.utils import parametrizations, parametrize

from vcdask.errors import DataError


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


def test_a_model_on_the_meta_device_is_refused_with_its_remedy(xy, tmp_path):
    """A model built under ``torch.device("meta")`` (shapes without values) gave torch's bare 'Cannot copy out of
    meta tensor; no data!' from vcdask's copy of it."""
    with torch.device("meta"):
        model = _mlp()
    _refused(
        model,
        xy,
        tmp_path,
        ValueError,
        "the model's 0.weight, 0.bias, 2.weight, 2.bias are on the meta device",
        "model.to_empty(device='cpu')",
    )


def test_a_float64_model_is_taken(xy, tmp_path):
    from vcdask.options import plan

    X, y = xy
    assert plan(_mlp().double(), (X.astype("float64"), y), store=tmp_path / "s").x_dtype == torch.float64


class _Symmetric(torch.nn.Module):
    def forward(self, w):
        return (w + w.T) / 2


def _parametrized(kind):
    model = _mlp()
    if kind == "custom":
        model[0] = torch.nn.Linear(6, 6)
        model[2] = torch.nn.Linear(6, 3)
        parametrize.register_parametrization(model[0], "weight", _Symmetric())
    elif kind == "orthogonal":
        model[2] = parametrizations.orthogonal(torch.nn.Linear(8, 3))
    else:
        getattr(parametrizations, kind)(model[0])
    return model


@pytest.mark.parametrize(
    ("kind", "where", "by"),
    [
        ("weight_norm", "0", "_WeightNorm"),
        ("spectral_norm", "0", "_SpectralNorm"),
        ("orthogonal", "2", "_Orthogonal"),
        ("custom", "0", "_Symmetric"),
    ],
)
def test_a_parametrized_model_is_refused_before_any_cluster_work(kind, where, by, xy, tmp_path):
    """Else data staging and the first commit come first, and the spec's pickling fails ('Serialization of
    parametrized modules is only supported through state_dict()')."""
    model = _parametrized(kind)
    _refused(
        model,
        xy,
        tmp_path,
        TypeError,
        f"parametrized tensors (torch.nn.utils.parametrize): {where}.weight (by {by})",
        "torch pickles a parametrized module only through its state_dict()",
        f"parametrize.remove_parametrizations(model.get_submodule('{where}'), 'weight')",
    )
    # the remedy as the message gives it: the model is then taken
    parametrize.remove_parametrizations(model.get_submodule(where), "weight")
    from vcdask.options import plan

    assert plan(model, xy, store=tmp_path / "s").model is model


def _old_style(norm):
    model = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch deprecates them for the parametrizations)
        getattr(torch.nn.utils, norm)(model[0])
    return model


def test_the_older_weight_norm_is_refused_with_its_remedy(xy, tmp_path):
    """Its weight, kept on the module as a tensor computed from weight_g and weight_v, fails the model's copy in
    the pre-flight with torch's 'Only Tensors created explicitly by the user (graph leaves) support the deepcopy
    protocol'."""
    model = _old_style("weight_norm")
    _refused(
        model,
        xy,
        tmp_path,
        TypeError,
        "the model holds 0.weight as a tensor computed from its parameters",
        "torch.nn.utils.remove_weight_norm(model.get_submodule('0'), 'weight')",
    )
    torch.nn.utils.remove_weight_norm(model[0], "weight")
    from vcdask.options import plan

    assert plan(model, xy, store=tmp_path / "s").model is model


def test_a_buffer_computed_from_a_parameter_is_refused_with_its_remedy(xy, tmp_path):
    """``register_buffer("b", self.l.weight * 2)`` keeps a tensor of the autograd graph, which the model's copy
    refuses as the older weight norm's does; registered detached it is taken."""

    class Scaled(torch.nn.Module):
        def __init__(self, detach: bool):
            super().__init__()
            self.l = torch.nn.Linear(6, 3)
            w = self.l.weight * 2
            self.register_buffer("b", w.detach() if detach else w)

        def forward(self, x):
            return self.l(x) + self.b.sum()

    _refused(Scaled(False), xy, tmp_path, TypeError, "the model holds b as a tensor computed", "(.detach())")
    from vcdask.options import plan

    assert isinstance(plan(Scaled(True), xy, store=tmp_path / "s").model, Scaled)


def test_the_older_spectral_norm_is_taken_and_after_a_forward_pass_refused_with_its_remedy(xy, tmp_path):
    """As it comes it pickles and trains; a forward pass that tracked gradients leaves its weight a computed
    tensor, which cannot be copied."""
    from vcdask.options import plan

    model = _old_style("spectral_norm")
    assert plan(model, xy, store=tmp_path / "s").model is model
    model(torch.from_numpy(xy[0]))
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(model)
    _refused(model, xy, tmp_path, TypeError, "0.weight is torch.nn.utils.spectral_norm's", "torch.no_grad()")


class _Outputs(torch.nn.Module):
    """Logits and probabilities, as a tuple or a dict."""

    def __init__(self, form):
        super().__init__()
        torch.manual_seed(0)
        self.l, self.form = torch.nn.Linear(6, 3), form

    def forward(self, x):
        logits = self.l(x)
        if self.form == "dict":
            return {"logits": logits, "proba": logits.softmax(-1)}
        return logits, logits.softmax(-1)


@pytest.mark.parametrize(
    ("form", "labels", "shown"),
    [
        ("tuple", "classes", "a tuple of 2 (Tensor, Tensor)"),
        ("tuple", "floats", "a tuple of 2 (Tensor, Tensor)"),
        ("dict", "classes", "a dict with keys ['logits', 'proba']"),
    ],
)
def test_outputs_the_default_step_cannot_train_on_are_refused(form, labels, shown, xy, tmp_path):
    """Not an AttributeError ('tuple' object has no attribute 'dim', or raised while building the loss's
    message): the default step needs one tensor; a train_step picks the output."""
    X, y = xy
    _refused(
        _Outputs(form),
        (X, y if labels == "classes" else X[:, :3].copy()),
        tmp_path,
        DataError,
        f"needs the model to return one tensor, but it returns {shown}",
        "pass train_step=fn(model, batch)",
        "eval_step=",
    )


def test_a_tuple_output_with_a_train_step_is_taken(xy, tmp_path):
    from vcdask.options import plan

    def step(model, batch):
        x, y = batch
        logits, _ = model(x)
        return torch.nn.functional.cross_entropy(logits, y)

    model = _Outputs("tuple")
    assert plan(model, xy, train_step=step, store=tmp_path / "s").model is model
