"""Mistakes of a first hour with vcdask, each refused by ``fit`` before any cluster or store work, with a message
that names the cause and the remedy (through the real ``fit`` path: :func:`refusal_helpers.refused`)."""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch
from refusal_helpers import refused

from vcdask.device import cpu_copy
from vcdask.errors import DataError

N = 64


@pytest.fixture
def X():
    return np.random.default_rng(0).normal(size=(N, 8)).astype("float32")


def _linear(n_out=1):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, n_out))


@pytest.mark.parametrize(
    ("loss", "shown"),
    [
        (torch.nn.MSELoss(), "loss=torch.nn.MSELoss()"),
        (torch.nn.L1Loss(reduction="sum"), "loss=torch.nn.L1Loss(reduction='sum')"),
        (torch.nn.HuberLoss(), "loss=torch.nn.HuberLoss()"),
        (torch.nn.SmoothL1Loss(), "loss=torch.nn.SmoothL1Loss()"),
        (functools.partial(torch.nn.functional.huber_loss, delta=2.0), "loss=torch.nn.functional.huber_loss"),
    ],
)
def test_elementwise_loss_modules_that_would_broadcast_are_refused(X, tmp_path, loss, shown):
    y = np.random.default_rng(1).normal(size=N).astype("float32")  # (n,) labels against (n, 1) outputs
    refused(
        _linear(1),
        (X, y),
        tmp_path,
        DataError,
        shown,
        "would compare model outputs of shape (n, 1) with labels of shape (n,) by broadcasting them to (n, n)",
        "y.reshape(-1, 1)",
        loss=loss,
    )


def test_integer_regression_targets_on_one_output_say_to_pass_float_labels(X, tmp_path):
    y = np.random.default_rng(1).integers(-85, 81, size=N)  # int64 regression targets
    refused(
        _linear(1),
        (X, y),
        tmp_path,
        DataError,
        "are integers (int64)",
        "which vcdask takes as class ids",
        "the model has one output per sample",
        "for a regression, or one logit per label",
        "y.astype('float32'), shaped like the outputs: y.reshape(-1, 1)",
    )


def test_integer_01_labels_of_a_one_output_model_say_two_outputs_or_float_labels(X, tmp_path):
    y = np.random.default_rng(1).integers(0, 2, size=N)
    refused(
        _linear(1),
        (X, y),
        tmp_path,
        DataError,
        "give the model 2 outputs (one per class 0..1) and leave loss= unset",
        "y.astype('float32'), shaped like the outputs: y.reshape(-1, 1)",
    )


def test_a_pandas_bool_label_column_on_a_one_output_model_says_what_to_do(X, tmp_path):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(X, columns=[f"f{i}" for i in range(8)]).assign(t=X[:, 0] > 0)
    refused(
        _linear(1),
        frame,
        tmp_path,
        DataError,
        "give the model 2 outputs (one per class 0..1)",
        "y.astype('float32')",
        label="t",
    )


@pytest.mark.parametrize(
    ("shape", "n_out", "fragment"),
    [
        ((N,), 1, "y.astype('float32'), shaped like the outputs: y.reshape(-1, 1)"),  # the usual binary setup
        ((N, 3), 3, "pass float labels, y.astype('float32'); for a classifier"),  # multi-label
    ],
)
def test_integer_labels_with_bce_say_the_loss_takes_float_labels(X, tmp_path, shape, n_out, fragment):
    y = np.random.default_rng(1).integers(0, 2, size=shape)
    message = refused(
        _linear(n_out),
        (X, y),
        tmp_path,
        DataError,
        "loss=torch.nn.BCEWithLogitsLoss() takes float labels",
        fragment,
        loss=torch.nn.BCEWithLogitsLoss(),
    )
    assert "can't be cast" not in message


def test_float_01_labels_with_bce_and_n_1_outputs_say_how_to_shape_them(X, tmp_path):
    y = (X[:, 0] > 0).astype("float32")  # (n,) against (n, 1) outputs
    refused(
        _linear(1),
        (X, y),
        tmp_path,
        DataError,
        "Target size",
        "give them that shape: y.reshape(-1, 1)",
        loss=torch.nn.BCEWithLogitsLoss(),
    )


def _locked_loss():
    lock = threading.Lock()

    def loss(output, target):
        with lock:
            return torch.nn.functional.mse_loss(output.reshape(target.shape), target)

    return loss


@pytest.mark.parametrize("option", ["loss", "metrics", "collate_fn"])
def test_an_option_that_cannot_be_pickled_is_refused_before_the_store_is_made(X, tmp_path, option):
    y = np.random.default_rng(1).normal(size=N).astype("float32")
    fn = _locked_loss()
    value = {"metrics": {"locked": fn}}.get(option, fn)
    fragments = [f"{option}= cannot be pickled", "closure variable 'lock', a _thread.lock", "inside the function"]
    if option == "metrics":
        fragments.append("item 'locked', a function")
    refused(_linear(1), (X, y), tmp_path, TypeError, *fragments, **{option: value})


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)
        self.lock = threading.Lock()

    def forward(self, x):
        return self.linear(x).squeeze(-1)


def test_a_model_attribute_that_cannot_be_pickled_is_named_with_its_module(X, tmp_path):
    y = np.random.default_rng(1).normal(size=N).astype("float32")
    model = torch.nn.Sequential(torch.nn.Identity(), _Head())
    fragments = ["its module '1' (_Head) holds attribute 'lock', a _thread.lock", "__getstate__", "lazily"]
    refused(model, (X, y), tmp_path, TypeError, *fragments)
    with pytest.raises(TypeError, match="its module '1' \\(_Head\\) holds attribute 'lock'"):
        cpu_copy(model)  # (the copy vcdask's checks make names it too)


class _LockLeftOut(torch.nn.Module):
    """A module holding a lock it leaves out of its pickled state (and makes again): it pickles."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)
        self.lock = threading.Lock()

    def __getstate__(self):
        state = super().__getstate__()
        del state["lock"]
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.lock = threading.Lock()

    def forward(self, x):
        with self.lock:
            return self.linear(x).squeeze(-1)


def _compiled():
    torch.manual_seed(0)
    return torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Flatten(0)), backend="eager")


@pytest.mark.parametrize(
    "make",
    [_compiled, lambda: torch.nn.Sequential(torch.nn.Identity(), _LockLeftOut())],
    ids=["torch.compile", "lock left out by __getstate__"],
)
def test_a_model_that_pickles_its_own_way_passes_the_pickling_check(make):
    """The check pickles the model as the run does (its modules' own __getstate__ / __reduce__: a torch.compile'd
    model's, a module's that leaves its lock out), not each module's attributes apart."""
    from vcdask._pickle_check import check_picklable

    model = make()
    check_picklable(model, {"loss": None})
    cpu_copy(model)  # (the copy vcdask's checks make)


class _SecondLock(_LockLeftOut):
    def __init__(self):
        super().__init__()
        self.other = threading.Lock()  # (kept by its __getstate__: it does not pickle)


def test_an_attribute_a_modules_own_getstate_keeps_is_named_with_that_remedy(X, tmp_path):
    y = np.random.default_rng(1).normal(size=N).astype("float32")
    model = torch.nn.Sequential(torch.nn.Identity(), _SecondLock())
    fragments = ["its module '1' (_SecondLock) holds attribute 'other', a _thread.lock", "its class's __getstate__"]
    message = refused(model, (X, y), tmp_path, TypeError, *fragments)
    assert "'lock'" not in message


def test_the_pickling_check_pickles_no_weights(monkeypatch):
    """A big model's weights are not pickled by the pre-flight check (only what the run pickles besides them)."""
    import pickle

    from vcdask._pickle_check import check_picklable

    reduced = []
    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", lambda self, _proto: reduced.append(self) or (torch.zeros, ()))
    check_picklable(torch.nn.Sequential(torch.nn.Linear(8, 4), _LockLeftOut()), {})
    assert reduced == []
    pickle.dumps(torch.nn.Linear(2, 2))  # (the patch sees a tensor pickled the usual way)
    assert reduced


def test_a_torch_compiled_model_trains(X, tmp_path, threaded_client):
    import vcdask

    y = np.random.default_rng(1).normal(size=N).astype("float32")
    result = vcdask.fit(
        _compiled(), (X, y), client=threaded_client, store=tmp_path / "store", max_epochs=1, progress=False
    )
    assert result is not None


@pytest.mark.parametrize(
    ("typo", "meant"), [("epochs", "max_epochs="), ("learning_rate", "lr="), ("bach_size", "batch_size=")]
)
def test_a_keyword_typo_says_which_option_was_meant(X, tmp_path, typo, meant):
    y = np.random.default_rng(1).normal(size=N).astype("float32")
    refused(
        _linear(1),
        (X, y),
        tmp_path,
        TypeError,
        f"unexpected keyword argument {typo!r}; did you mean {meant}?",
        **{typo: 5},
    )


def test_an_optimizer_name_says_to_pass_its_class(X, tmp_path):
    y = np.random.default_rng(1).normal(size=N).astype("float32")
    fragments = ["got str 'adamw' (a name)", "optimizer=torch.optim.AdamW", "functools.partial(torch.optim.AdamW"]
    refused(_linear(1), (X, y), tmp_path, TypeError, *fragments, optimizer="adamw")


def test_an_optimizer_instance_says_to_pass_its_class_or_a_partial(X, tmp_path):
    y = np.random.default_rng(1).normal(size=N).astype("float32")
    model = _linear(1)
    built = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fragments = [
        "an optimizer built already",
        "optimizer=torch.optim.SGD",
        "functools.partial(torch.optim.SGD, momentum",
    ]
    refused(model, (X, y), tmp_path, TypeError, *fragments, optimizer=built)


def test_an_accuracy_target_given_as_a_percentage_is_refused(X, tmp_path):
    y = (X[:, 0] > 0).astype("int64")
    fragments = ["target {'accuracy': 95} can never be reached", "[0, 1]", "{'accuracy': 0.95}"]
    refused(_linear(2), (X, y), tmp_path, ValueError, *fragments, target={"accuracy": 95})


def test_a_target_of_a_metric_of_ones_own_is_not_bounded(X, tmp_path):
    """A metric of the user's named like vcdask's may report percentages: its target is not refused."""

    def accuracy(output, target):
        return 100 * float((output.argmax(1) == target).float().mean())

    y = (X[:, 0] > 0).astype("int64")
    with pytest.raises(AssertionError, match="fit touched the cluster"):  # (accepted: on to the cluster)
        refused(_linear(2), (X, y), tmp_path, ValueError, metrics=[accuracy], target={"accuracy": 95})


def test_a_lazy_module_not_run_yet_says_to_run_one_forward_pass(X, tmp_path):
    y = np.random.default_rng(1).normal(size=N).astype("float32")
    model = torch.nn.Sequential(torch.nn.LazyLinear(1), torch.nn.Flatten(0))
    fragments = ["lazy parameters that are not made yet, in module '0' (LazyLinear)", "Run one forward pass"]
    refused(model, (X, y), tmp_path, ValueError, *fragments)


@pytest.mark.parametrize("form", ["numpy", "torch"])
def test_class_ids_as_a_column_with_cross_entropy_say_to_pass_them_as_n(X, tmp_path, form):
    """Integer labels (n, 1) against outputs (n, C) with the default cross-entropy were refused in torch's words
    only ("0D or 1D target tensor expected, multi-target not supported"): the message says what to pass. (They
    keep their shape: a ``train_step`` of one's own may be written for (n, 1).)"""
    y = (X[:, :1] > 0).astype("int64")
    refused(
        _linear(2),
        (X, y if form == "numpy" else torch.from_numpy(y)),
        tmp_path,
        DataError,
        "labels of shape (4, 1)",
        "integer labels of shape (n, 1) are class ids as a column",
        "y.ravel()",
        "y[:, 0]",
    )
