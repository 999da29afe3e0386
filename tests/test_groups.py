"""The option groups (``vcdask.Merging``, ``vcdask.Training``, ``vcdask.Stopping``): each checks itself, ``fit``
takes them beside its flat arguments (one option set both ways is refused), and a run given the groups is the
run given the same options flat.  No worker processes: the one real run is on an in-process cluster."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import dask.config
import numpy as np
import pytest
import torch

import vcdask
from vcdask._docstrings import documented_parameters
from vcdask.errors import UnknownMergeRuleError
from vcdask.groups import GROUPS, Merging, Stopping, Training, fold, fold_options
from vcdask.options import plan

# -- each group checks itself, with the messages fit's flat options always had --------------------------------
BAD = [
    (Merging, {"rule": "nope"}, UnknownMergeRuleError, r"unknown merge rule 'nope'; choose one of \[.*'staleness'"),
    (Merging, {"rule": "nesterov", "alpha": 0.5}, ValueError, r"alpha=0\.5 does not apply to merge='nesterov'"),
    (Merging, {"rule": 3}, TypeError, r"merge must be a rule name \[.*\] or a MergeRule, got int"),
    (Merging, {"commit_every": 0}, ValueError, r"commit_every must be an integer >= 1 or 'auto', got 0"),
    (Merging, {"commit_every": "often"}, ValueError, r"commit_every must be an integer >= 1 or 'auto', got 'often'"),
    (Merging, {"compression": "zip"}, ValueError, r"compression must be None or one of \[.*'int8'.*\], got 'zip'"),
    (Merging, {"tasks_per_slot": 1.5}, TypeError, r"tasks_per_slot must be an integer >= 1, got 1\.5"),
    (Merging, {"speed_adaptive": "yes"}, TypeError, r"speed_adaptive must be True or False, got 'yes'"),
    (Training, {"lr": 0}, ValueError, r"lr must be a positive number, got 0"),
    (Training, {"lr": float("inf")}, ValueError, r"lr must be a positive number, got inf"),
    (Training, {"optimizer": "adam"}, TypeError, r"optimizer must be a torch\.optim\.Optimizer class .*got str"),
    (Training, {"lr_schedule": 3}, TypeError, r"lr_schedule must be a callable \(epoch, step\) -> factor"),
    (Training, {"clip_grad_norm": -1.0}, ValueError, r"clip_grad_norm must be a positive number or None, got -1\.0"),
    (Training, {"precision": "fp8"}, ValueError, r"precision must be one of \['32', 'bf16', '16-mixed'\], got 'fp8'"),
    (
        Training,
        {"optimizer_state": "kept"},
        ValueError,
        r"optimizer_state must be one of \['auto', 'fresh', 'worker'\]",
    ),
    (Training, {"local_epochs": 0}, ValueError, r"local_epochs must be an integer >= 1, got 0"),
    (Training, {"batch_size": "32"}, TypeError, r"batch_size must be an integer >= 1, got '32'"),
    (Training, {"device": "tpu"}, ValueError, r"device must be one of \['auto', 'cpu', .*\] \(or a torch\.device\)"),
    (Stopping, {"target": [0.9]}, TypeError, r"target must be a mapping like \{'accuracy': 0\.95\}, got \[0\.9\]"),
    (Stopping, {"target": {"accuracy": "high"}}, ValueError, r"target value for 'accuracy' must be a number"),
    (Stopping, {"patience": 0}, ValueError, r"patience must be an integer >= 1, got 0"),
    (Stopping, {"monitor": 3}, TypeError, r"monitor must be the name of a validation metric, got int"),
    (Stopping, {"validate_every": -2}, ValueError, r"validate_every must be an integer >= 1 or 'auto', got -2"),
]


@pytest.mark.parametrize(
    ("cls", "kwargs", "exc", "match"), BAD, ids=[f"{c.__name__}-{next(iter(k))}" for c, k, *_ in BAD]
)
def test_a_group_refuses_a_bad_value_naming_it_and_the_valid_choices(cls, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cls(**kwargs)


@pytest.mark.parametrize(
    ("cls", "kwargs", "exc", "match"), BAD, ids=[f"{c.__name__}-{next(iter(k))}" for c, k, *_ in BAD]
)
def test_fit_refuses_the_same_flat_value_with_the_same_message(cls, kwargs, exc, match, tmp_path):
    """The groups' checks are fit's: one message, whichever way the option is given (nothing is started)."""
    flat = {("merge" if k == "rule" else k): v for k, v in kwargs.items()}
    X, y = np.zeros((20, 2), "float32"), np.zeros(20, "int64")
    with pytest.raises(exc, match=match):
        vcdask.fit(torch.nn.Linear(2, 2), (X, y), store=tmp_path, progress=False, **flat)


def test_groups_keep_the_checked_form_of_their_values():
    training = Training(device=torch.device("cpu"), precision="bf16-mixed", clip_grad_norm=1, batch_size=np.int64(8))
    assert (training.device, training.precision, training.clip_grad_norm) == ("cpu", "bf16", 1.0)
    assert type(training.clip_grad_norm) is float and type(training.batch_size) is int and training.batch_size == 8
    assert Merging(commit_every=np.int64(3)).commit_every == 3 and Merging(commit_every="auto").commit_every == "auto"
    assert Stopping(target={"accuracy": 1}).target == {"accuracy": 1.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        training.lr = 0.1  # type: ignore[misc]


def test_numpy_scalars_are_numbers_and_bools_are_not(tmp_path):
    """np.float32 is no Python float, but it is a real number: every number option takes it (as a float)."""
    from vcdask.resilience import Resilience

    f32 = np.float32
    training = Training(lr=f32(0.01), clip_grad_norm=f32(1.5))
    assert type(training.lr) is float and training.lr == pytest.approx(0.01)
    assert type(training.clip_grad_norm) is float and training.clip_grad_norm == 1.5
    target = Stopping(target={"accuracy": f32(0.75)}).target
    assert target == {"accuracy": 0.75} and type(target["accuracy"]) is float
    assert Merging(alpha=f32(0.5)).alpha == 0.5 and type(Merging(alpha=f32(0.5)).alpha) is float
    assert Resilience(deadline=f32(30.0), min_cosine=f32(-0.5)).deadline == 30.0
    assert vcdask.lr_schedules.Cosine(warmup=f32(0.25)).warmup == 0.25
    X, y = np.zeros((20, 2), "float32"), np.zeros(20, "int64")
    assert plan(torch.nn.Linear(2, 2), (X, y), validation=f32(0.2), store=tmp_path).validation.n == 4
    for bad in (lambda: Training(lr=True), lambda: Stopping(target={"accuracy": True}), lambda: Merging(alpha=True)):
        with pytest.raises((TypeError, ValueError), match="True"):
            bad()


# -- the flat arguments and the groups: one set of defaults, and a clear refusal of both ----------------------
def _flat_names() -> dict[str, tuple[type, str]]:
    return {
        ("merge" if f.name == "rule" else f.name): (cls, f.name)
        for cls in GROUPS.values()
        for f in dataclasses.fields(cls)
    }


def test_every_group_field_is_a_flat_argument_of_fit_with_the_same_default():
    fit = inspect.signature(vcdask.fit).parameters
    names = _flat_names()
    assert len(names) == 19  # 6 + 9 + 4
    wrong = {}
    for name, (cls, field) in names.items():
        ours, theirs = fit[name].default, next(f.default for f in dataclasses.fields(cls) if f.name == field)
        if ours != theirs or type(ours) is not type(theirs):
            wrong[name] = (ours, theirs)
    assert not wrong, f"fit's default != the group's (fit, group): {wrong}"
    assert {"merging", "training", "stopping"} <= set(fit)


def test_plan_takes_fits_other_options_with_fits_defaults():
    fit = inspect.signature(vcdask.fit).parameters
    planned = inspect.signature(plan).parameters
    assert set(planned) == set(fit) - set(_flat_names()) - {"extra", "progress", "wait"}
    wrong = {
        n: (fit[n].default, p.default)
        for n, p in planned.items()
        if p.default != fit[n].default or type(p.default) is not type(fit[n].default)
    }
    assert not wrong, f"plan's default != fit's (fit, plan): {wrong}"


@pytest.mark.parametrize("cls", [Merging, Training, Stopping])
def test_every_field_is_documented_with_its_real_default(cls):
    docs = documented_parameters(cls)
    assert set(docs) == {f.name for f in dataclasses.fields(cls)}
    for doc in docs.values():
        if doc.type_default is not None:
            assert ast.literal_eval(doc.type_default) == doc.signature_default, doc.name


def test_fold_puts_flat_arguments_into_the_group():
    assert fold(Training, None, lr=0.05) == Training(lr=0.05)
    # a flat argument at its default leaves the group's field; another field of the group is kept
    assert fold(Training, Training(batch_size=64), lr=0.05, batch_size=32) == Training(lr=0.05, batch_size=64)
    assert fold(Merging, None, merge="staleness", alpha=0.5) == Merging(rule="staleness", alpha=0.5)
    group = Stopping(patience=2)
    assert fold(Stopping, group, target=None, patience=None) is group


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fold(Training, Training(lr=0.01), lr=0.1), "lr=0.1 and training=Training(lr=0.01) both set lr"),
        (
            lambda: fold(Merging, Merging(rule="staleness"), merge="vc-asgd"),
            "merge='vc-asgd' and merging=Merging(rule='staleness') both set rule: pass it once, as merge= or in "
            "merging=",
        ),
        (
            lambda: fold(Stopping, Stopping(patience=3), patience=3),  # equal values are still given twice
            "patience=3 and stopping=Stopping(patience=3) both set patience",
        ),
        (lambda: fold(Training, {"lr": 0.1}), "training must be a vcdask.Training, got dict"),
        (
            lambda: fold(Merging, None, rule="sync"),
            "rule is not a flat option of vcdask.Merging; its options: ['merge'",
        ),
    ],
)
def test_fold_refuses_an_option_given_twice_or_a_wrong_group(call, message):
    with pytest.raises(TypeError) as info:
        call()
    assert message in str(info.value)


def test_fit_refuses_an_option_given_flat_and_in_its_group_before_any_work(tmp_path):
    X, y = np.zeros((20, 2), "float32"), np.zeros(20, "int64")
    with pytest.raises(TypeError, match=r"lr=0\.1 and training=Training\(lr=0\.01\) both set lr: pass it once"):
        vcdask.fit(torch.nn.Linear(2, 2), (X, y), lr=0.1, training=Training(lr=0.01), store=tmp_path / "s")
    with pytest.raises(TypeError, match=r"merging must be a vcdask\.Merging, got dict"):
        vcdask.fit(torch.nn.Linear(2, 2), (X, y), merging={"rule": "sync"}, store=tmp_path / "s")
    assert not (tmp_path / "s").exists()  # refused before the store was made


def test_plan_holds_the_typed_groups_with_what_the_data_decided(tmp_path):
    X = np.random.default_rng(0).normal(size=(100, 4)).astype("float32")
    y = (X[:, 0] > 0).astype("int64")
    planned = plan(
        torch.nn.Linear(4, 2),
        (X, y),
        store=tmp_path,
        merging=Merging(rule="staleness", alpha=0.5, commit_every="auto"),
        training=Training(lr=0.05, batch_size=16),
        stopping=Stopping(target={"accuracy": 1}, patience=2),
    )
    assert planned.merging.commit_every == "auto" and planned.rule.name == "staleness" and planned.rule.alpha == 0.5
    assert planned.optimizer.keywords == {"lr": 0.05} and planned.training.batch_size == 16
    # 10% held out for the target and the patience; the monitor is the target's metric
    assert planned.train.n == 90 and planned.validation is not None and planned.validation.n == 10
    assert planned.stopping == Stopping(target={"accuracy": 1.0}, patience=2, monitor="accuracy")
    assert planned.metric_names == ("loss", "accuracy") and planned.step_metrics == ()
    with pytest.raises(ValueError, match=r"target metric 'f1' is not computed; available: \['loss', 'accuracy'\]"):
        plan(torch.nn.Linear(4, 2), (X, y), store=tmp_path, stopping=Stopping(target={"f1": 0.5}))


# -- one run, given flat or grouped ----------------------------------------------------------------------------
def _run(client, store, **options):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 4)).astype("float32")
    y = (X[:, 0] + X[:, 1] > 0).astype("int64")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return vcdask.fit(model, (X, y), max_epochs=3, n_shards=4, client=client, store=store, progress=False, **options)


def test_a_run_given_the_groups_is_the_run_given_the_same_options_flat(tmp_path):
    """One worker thread, workers in this process, each task waiting for the merge before it (overlap "wait"):
    the run is deterministic, so the same options given either way give the same parameters and metrics."""
    from distributed import Client, LocalCluster

    from vcdask.spec import load_spec

    flat = {
        "merge": "staleness",
        "alpha": 0.5,
        "commit_every": 2,
        "lr": 0.05,
        "batch_size": 16,
        "optimizer_state": "fresh",
        "target": {"accuracy": 0.99},
        "validate_every": 2,
    }
    grouped = {
        "merging": Merging(rule="staleness", alpha=0.5, commit_every=2),
        "training": Training(lr=0.05, batch_size=16, optimizer_state="fresh"),
        "stopping": Stopping(target={"accuracy": 0.99}, validate_every=2),
    }
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0")
    with dask.config.set({"vcdask.worker.overlap": "wait"}), cluster, Client(cluster) as client:
        one = _run(client, tmp_path / "flat", **flat)
        other = _run(client, tmp_path / "grouped", **grouped)
        training = {"lr": 0.05, "batch_size": 16, "optimizer_state": "fresh"}  # flat, beside the other groups
        mixed = _run(client, tmp_path / "mixed", merging=grouped["merging"], stopping=grouped["stopping"], **training)
    for result in (other, mixed):
        for a, b in zip(one.model.parameters(), result.model.parameters(), strict=True):
            assert torch.equal(a, b)
        assert result.epochs["accuracy"].tolist() == one.epochs["accuracy"].tolist()
        assert result.epochs["version"].tolist() == one.epochs["version"].tolist()
    assert len(one.epochs) == 3 and one.epochs["version"].tolist()[-1] == 12  # 3 epochs of 4 shards
    specs = [load_spec(r.store, r.run_id) for r in (one, other)]
    for spec in specs:  # what the engine reads: the groups' values, in the spec's own fields
        assert (spec.commit_every, spec.batch_size, spec.validate_every) == (2, 16, 2)
        assert spec.merge.name == "staleness" and spec.merge.alpha == 0.5 and spec.optimizer.keywords == {"lr": 0.05}
        assert spec.target == {"accuracy": 0.99} and spec.optimizer_state == "fresh" and spec.monitor == "accuracy"
        assert spec.overlap == "wait"


# -- a job file takes the groups as mappings under fit: ----------------------------------------------------------
@pytest.fixture
def job_dir(tmp_path):
    import pandas as pd

    # a module name of its own: test_job.py's mymodels.py (another factory) may be imported already
    (tmp_path / "groups_models.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(4, 2)\n")
    X = np.random.default_rng(0).normal(size=(120, 4)).astype("float32")
    frame = pd.DataFrame({**{f"f{i}": X[:, i] for i in range(4)}, "target": (X[:, 0] > 0).astype("int64")})
    frame.to_csv(tmp_path / "train.csv", index=False)
    return tmp_path


def _job(job_dir, fit: str):
    from vcdask.jobs import load_job

    text = f"""
    model: groups_models:make
    data: {{path: train.csv, label: target}}
    store: store
    fit: {fit}
    """
    path = job_dir / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return load_job(path)


def test_a_job_file_gives_the_groups_as_mappings(job_dir):
    from vcdask.jobs import preflight

    job = _job(job_dir, "{max_epochs: 2, merging: {rule: staleness, alpha: 0.5}, training: {lr: 0.05}}")
    assert job.fit["merging"] == Merging(rule="staleness", alpha=0.5) and job.fit["training"] == Training(lr=0.05)
    assert preflight(job).job is job
    assert fold_options(job.fit)["training"] == Training(lr=0.05)


def test_a_job_file_names_the_field_of_a_bad_group_or_an_option_given_twice(job_dir):
    from vcdask.jobs import JobFileError, preflight

    with pytest.raises(JobFileError, match=r"job\.yaml: fit\.stopping: patience must be an integer >= 1, got 0"):
        _job(job_dir, "{stopping: {patience: 0}}")
    with pytest.raises(JobFileError) as info:
        preflight(_job(job_dir, "{lr: 0.05, training: {lr: 0.1}}"))
    assert info.value.field == "fit"
    assert "rejected by vcdask.fit: lr=0.05 and training=Training(lr=0.1) both set lr" in str(info.value)
