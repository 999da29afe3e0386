"""``vcdask train JOB.yaml``: the job file's checks (no cluster), and two scheduled runs end to end as subprocesses."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from process_helpers import wait_for_merges

import vcdask
from vcdask.batches import cast_like_training
from vcdask.jobs import (
    EXIT_BAD_JOB,
    EXIT_FAILED,
    JobFileError,
    ReleaseRule,
    job_schema,
    last_release,
    load_job,
    preflight,
    run_job,
    score,
)
from vcdask.jobs._preflight import fit_kwargs
from vcdask.jobs._run import _compare, _release
from vcdask.spec import load_spec

ROOT = Path(__file__).parents[1]

MODELS = """
import torch

def make(hidden: int = 16, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))

def not_a_model(**kwargs):
    return 42

def stopped_while_built(**kwargs):  # as if the scheduler stopped the job during its pre-flight
    import os, signal

    os.kill(os.getpid(), signal.SIGTERM)
    return make()
"""

JOB = """
model: mymodels:make
model_args: {hidden: 16}
data: {path: train.zarr, features: x, label: y}
validation: val.zarr
store: store
start: last-release
fit: {max_epochs: 2, lr: 0.05}
release: {metric: accuracy, tag_prefix: nightly-}
report: reports/report.json
"""


def _tabular(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    X = np.random.default_rng(seed).normal(size=(n, 4)).astype("float32")
    return X, (X[:, 0] + X[:, 1] > 0).astype("int64")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Zarr training (240 rows) and validation (80 rows) data, and the same training rows as CSV."""
    import pandas as pd
    import xarray as xr

    d = tmp_path_factory.mktemp("data")
    for name, n, seed in (("train", 240, 0), ("val", 80, 1)):
        X, y = _tabular(n, seed)
        ds = xr.Dataset({"x": (("sample", "feature"), X), "y": (("sample",), y)})
        ds.to_zarr(d / f"{name}.zarr", mode="w", zarr_format=3, consolidated=False)
    X, y = _tabular(240, 0)
    pd.DataFrame({**{f"f{i}": X[:, i] for i in range(4)}, "target": y}).to_csv(d / "train.csv", index=False)
    return d


@pytest.fixture
def job_dir(tmp_path, data_dir) -> Path:
    """A directory with mymodels.py beside a job file, and the data (symlinked)."""
    (tmp_path / "mymodels.py").write_text(MODELS)
    for name in ("train.zarr", "val.zarr", "train.csv"):
        (tmp_path / name).symlink_to(data_dir / name)
    (tmp_path / "job.yaml").write_text(JOB)
    return tmp_path


def _write(job_dir: Path, text: str, name: str = "job.yaml") -> Path:
    path = job_dir / name
    path.write_text(textwrap.dedent(text))
    return path


def _edit(job_dir: Path, old: str, new: str, name: str = "job.yaml") -> Path:
    text = JOB.replace(old, new)
    assert text != JOB, old
    return _write(job_dir, text, name)


# -- the job file's checks: no store, no cluster ---------------------------------------------------------------
def test_a_good_job_file_is_read_with_paths_from_its_directory(job_dir):
    job = load_job(job_dir / "job.yaml")
    assert job.factory(hidden=3)[0].out_features == 3  # mymodels.py beside the job file was imported
    assert job.data.path == str(job_dir / "train.zarr") and job.data.features == ("x",) and job.data.label == "y"
    assert job.validation.path == str(job_dir / "val.zarr") and job.validation.label == "y"  # the data's variables
    assert job.store == str(job_dir / "store") and job.report == job_dir / "reports" / "report.json"
    assert job.fit == {"max_epochs": 2, "lr": 0.05}
    assert job.release == ReleaseRule(metric="accuracy", mode="max", tag_prefix="nightly-", min_delta=0.0)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("max_epochs: 2", "max_epoch: 2", r"job\.yaml: fit\.max_epoch: unknown option; valid: .*max_epochs"),
        ("fit: {", "fit: {store: elsewhere, ", r"job\.yaml: fit\.store: set by the job file's store field"),
        ("report:", "reprot:", r"job\.yaml: reprot: unknown field; valid: .*report"),
        ("model: mymodels:make", "", r"job\.yaml: model: missing \(required\)"),
        ("mymodels:make", "mymodel:make", r"job\.yaml: model: cannot import 'mymodel'.*looked beside the job file"),
        ("mymodels:make", "mymodels:build", r"job\.yaml: model: 'mymodels' has no 'build'; its callables: \['make'"),
        ("mymodels:make", "mymodels make", r"job\.yaml: model: 'mymodels make' does not match"),
        ("metric: accuracy", "metric: acc", r"job\.yaml: release\.metric: unknown metric 'acc'; valid .*'accuracy'"),
        ("tag_prefix: nightly-}", "tag_prefix: nightly-, mode: up}", r"job\.yaml: release\.mode: 'up' is not one of"),
        ("validation: val.zarr", "", r"job\.yaml: release: a release compares validation metrics: add validation:"),
        (
            "start: last-release",
            "start: {tag: a, version: b}",
            r"job\.yaml: start: .*too many properties\. Where training starts: 'last-release'",
        ),
        ("train.zarr", "missing.zarr", r"job\.yaml: data\.path: no such file: .*missing\.zarr"),
        ("{path: train.zarr, features: x, label: y}", "train.csv", r"job\.yaml: data\.label: a csv file needs label:"),
        (
            "{path: train.zarr, features: x, label: y}",
            "{path: train.csv, label: target, sample_dim: row}",
            r"job\.yaml: data\.sample_dim: a csv file's samples are its rows: leave sample_dim out",
        ),
        ("max_epochs: 2", "max_epochs: 2, resilience: {deadline: soon}", r"job\.yaml: fit\.resilience: "),
        # a job waits for its run (it scores and releases it): wait: false would fail only after training began
        (
            "max_epochs: 2",
            "max_epochs: 2, wait: false",
            r"job\.yaml: fit\.wait: not an option of a job: a job always waits",
        ),
        ("max_epochs: 2", "max_epochs: 2, wait: true", r"job\.yaml: fit\.wait: not an option of a job"),
        ("max_epochs: 2", "max_epochs: 2, collate_fn: x", r"job\.yaml: fit\.collate_fn: .*takes a Python callable"),
        ("max_epochs: 2", "max_epochs: 2, train_step: m:f", r"job\.yaml: fit\.train_step: .*takes a Python callable"),
        # PyYAML reads 1e-3 as a string (a YAML 1.1 float needs a dot and a signed exponent): say so
        (
            "tag_prefix: nightly-}",
            "tag_prefix: nightly-, min_delta: 1e-3}",
            r"release\.min_delta: '1e-3' is not of type 'number'; YAML reads 1e-3 \(release\.min_delta\) as text: "
            r"write 1\.0e-3 or 0\.001$",
        ),
        (
            "max_epochs: 2",
            "max_epochs: 2, stopping: {target: {loss: 1E2}}",
            r"fit\.stopping: .*got '1E2'; YAML reads 1E2 \(fit\.stopping\.target\.loss\) as text: "
            r"write 1\.0e\+2 or 100$",
        ),
    ],
)
def test_a_bad_job_file_names_the_field(job_dir, old, new, message):
    path = _edit(job_dir, old, new)
    with pytest.raises(JobFileError, match=message):
        load_job(path)


def test_a_wrong_feature_name_is_blamed_on_data_features(job_dir):
    """The data's mistakes name the data's field, not ``fit:`` (which only passed them on)."""
    with pytest.raises(JobFileError, match=r"job\.yaml: data\.features: .*feature variable\(s\) \['z'\] not in"):
        preflight(load_job(_edit(job_dir, "features: x", "features: z")))
    with pytest.raises(JobFileError, match=r"job\.yaml: data\.label: "):
        preflight(load_job(_edit(job_dir, "label: y}", "label: nope}")))


def test_a_model_that_does_not_fit_the_training_data_is_not_blamed_on_validation(job_dir):
    """Five feature columns for a model that takes four: the model's field, whether or not the job holds out
    validation data; a refusal of the validation data itself still names ``validation``."""
    import pandas as pd

    X, y = _tabular(40, 0)
    columns = {f"f{i}": X[:, i] for i in range(4)}
    pd.DataFrame({**columns, "f4": X[:, 0], "target": y}).to_csv(job_dir / "five.csv", index=False)
    text = "model: mymodels:make\ndata: {path: five.csv, label: target}\nstore: store\nfit: {max_epochs: 1}\n"
    for validation in ("", "validation: 0.25\n"):
        with pytest.raises(JobFileError) as info:
            preflight(load_job(_write(job_dir, text + validation)))
        assert info.value.field == "model", (validation, str(info.value))
        assert "the model cannot process the training data: samples of shape (5,)" in str(info.value)
    pd.DataFrame({**columns, "target": y}).assign(f0=np.nan).to_csv(job_dir / "bad_val.csv", index=False)
    four = text.replace("five.csv", "train.csv") + "validation: bad_val.csv\n"
    with pytest.raises(
        JobFileError, match=r"job\.yaml: validation: rejected by vcdask\.fit: validation: feature columns have missing"
    ):
        preflight(load_job(_write(job_dir, four)))


def test_not_yaml_and_not_there(job_dir):
    with pytest.raises(JobFileError, match=r"job\.yaml: not valid YAML at line 2"):
        load_job(_write(job_dir, "model: [a\nfit: {"))
    with pytest.raises(JobFileError, match=r"nope\.yaml: cannot read the job file"):
        load_job(job_dir / "nope.yaml")


def test_a_job_file_that_is_not_utf8_is_a_bad_job_file(job_dir):
    """A job file saved as Latin-1 (``# résumé``) is exit 2 naming the file, not a UnicodeDecodeError."""
    path = job_dir / "job.yaml"
    path.write_bytes("# r\u00e9sum\u00e9\n".encode("latin-1") + JOB.encode())
    with pytest.raises(JobFileError, match=r"^job\.yaml: not UTF-8 text: byte 0xe9 at line 1; save the file as UTF-8$"):
        load_job(path)
    outcome = run_job(path)
    assert outcome.exit_code == EXIT_BAD_JOB and outcome.message.startswith("job.yaml: not UTF-8 text")
    assert not (job_dir / "reports").exists()  # where the report goes cannot be read either


def test_report_under_the_home_directory(job_dir, monkeypatch):
    """``report: ~/x.json`` is in the home directory, as ``store:`` and ``data:`` paths are, not in a ``~`` folder."""
    home = job_dir / "home"
    monkeypatch.setenv("HOME", str(home))
    assert load_job(_edit(job_dir, "report: reports/report.json", "report: ~/x.json")).report == home / "x.json"
    outcome = run_job(_write(job_dir, JOB.replace("max_epochs: 2", "max_epoch: 2").replace("reports/", "~/")))
    assert outcome.exit_code == EXIT_BAD_JOB  # its report is written where the file says, though it failed its checks
    assert json.loads((home / "report.json").read_text())["exit_code"] == 2
    assert not (job_dir / "~").exists()


def test_release_mode_defaults_from_the_metric(job_dir):
    loss = load_job(_edit(job_dir, "metric: accuracy", "metric: loss")).release
    assert (loss.mode, loss.beats(0.5, 0.6), loss.beats(0.6, 0.5)) == ("min", True, False)
    mae = load_job(_edit(job_dir, "fit: {", "fit: {metrics: [mae, accuracy], ")).release
    assert mae.mode == "max"  # accuracy
    rule = ReleaseRule("accuracy", "max", "nightly-", min_delta=0.1)
    assert rule.improvement(0.95, 0.9) == pytest.approx(0.05)
    assert not rule.beats(0.95, 0.9) and rule.beats(0.95, 0.8)
    assert not ReleaseRule("accuracy", "max").beats(0.9, 0.9)  # equal is not better


def test_last_release_is_the_highest_number():
    tags = {"nightly-9": "A", "nightly-10": "B", "nightly-x": "C", "release-20": "D", "nightly-": "E"}
    assert last_release(tags, "nightly-") == (10, "nightly-10")
    assert last_release(tags, "weekly-") == (0, None)


def test_the_schema_ships_with_the_package_and_describes_the_docs_examples():
    import jsonschema
    import yaml

    schema = job_schema()
    assert set(schema["required"]) == {"model", "data", "store"}
    assert "jobs/job.schema.json" in (ROOT / "pyproject.toml").read_text()  # package data
    page = (ROOT / "docs" / "user-guide" / "scheduled-jobs.md").read_text()
    jobs = [yaml.safe_load(block) for block in re.findall(r"```yaml\n# job\.yaml\n(.*?)```", page, re.S)]
    assert len(jobs) >= 2
    for job in jobs:
        jsonschema.validate(job, schema)


def test_preflight_checks_the_store_and_the_start(job_dir):
    store = vcdask.open_store(job_dir / "store")
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    v = store.commit(model, {"step": 0})
    store.tag("nightly-1", v)

    with pytest.raises(JobFileError, match=r"job\.yaml: start\.tag: no tag 'gold' in .*; tags: \['nightly-1'\]"):
        preflight(load_job(_edit(job_dir, "start: last-release", "start: {tag: gold}")))
    with pytest.raises(JobFileError, match=r"start\.branch: no versions on branch 'run-x' .*branches: \['main'\]"):
        preflight(load_job(_edit(job_dir, "start: last-release", "start: {branch: run-x}")))
    with pytest.raises(JobFileError, match=r"start\.version: no version 'NOPE'"):
        preflight(load_job(_edit(job_dir, "start: last-release", "start: {version: NOPE}")))
    with pytest.raises(JobFileError, match=r"job\.yaml: model: the model does not fit the start version"):
        preflight(load_job(_edit(job_dir, "hidden: 16", "hidden: 8")))
    with pytest.raises(JobFileError, match=r"job\.yaml: model: mymodels:not_a_model returned a int"):
        preflight(load_job(_edit(job_dir, "mymodels:make", "mymodels:not_a_model")))
    with pytest.raises(JobFileError, match=r"job\.yaml: model_args: mymodels:make\(\*\*model_args\) failed"):
        preflight(load_job(_edit(job_dir, "hidden: 16", "width: 16")))
    missing = _edit(job_dir, "store: store", "store: elsewhere\nstart: {tag: nightly-1}").read_text()
    with pytest.raises(JobFileError, match=r"job\.yaml: store: no vcdask store at local directory .*elsewhere"):
        preflight(load_job(_write(job_dir, missing.replace("start: last-release\n", ""))))
    csv = _edit(job_dir, "{path: train.zarr, features: x, label: y}", "{path: train.csv, label: label}")
    with pytest.raises(JobFileError, match=r"data\.label: no column\(s\) \['label'\] in .*columns: \['f0', 'f1'"):
        preflight(load_job(csv))

    prepared = preflight(load_job(_write(job_dir, JOB)))  # last-release: nightly-1, loaded into the factory's model
    assert prepared.start == {"kind": "last-release", "tag": "nightly-1", "version": v, "branch": None}
    assert torch.equal(prepared.model[0].weight, model[0].weight)
    for start, where in ((f"{{version: {v}}}", "version"), ("{branch: main}", "branch"), ("{tag: nightly-1}", "tag")):
        prepared = preflight(load_job(_edit(job_dir, "start: last-release", f"start: {start}")))
        assert prepared.start["kind"] == where and prepared.start["version"] == v
        assert torch.equal(prepared.model[2].bias, model[2].bias)


def test_a_factory_that_refuses_its_arguments_or_a_scheduler_that_is_no_address_is_a_bad_job_file(job_dir):
    """Any error of the factory on ``model_args`` (RuntimeError, ValueError: not only TypeError) and a
    ``scheduler:`` that cannot be an address are exit 2 naming the field, found before any cluster work."""
    for args, error in (("hidden: -1", "RuntimeError: Trying to create tensor with negative dimension -1"),
                        ("hidden: 16, seed: abc", "ValueError: invalid literal for int()")):  # fmt: skip
        outcome = run_job(_edit(job_dir, "hidden: 16", args))
        assert outcome.exit_code == EXIT_BAD_JOB, outcome.message
        assert outcome.message.startswith(f"job.yaml: model_args: mymodels:make(**model_args) failed: {error}")
        assert "give values the factory accepts" in outcome.message
    for address in ("not a url", "tcp://host", "foo://h:1", "tcp://h:port"):
        outcome = run_job(_write(job_dir, JOB + f"scheduler: {address}\n"))
        assert outcome.exit_code == EXIT_BAD_JOB, outcome.message
        assert outcome.message.startswith(f"job.yaml: scheduler: {address!r} is not a Dask scheduler address (")
        assert "write it as tcp://host:8786" in outcome.message
        assert "check_s" not in outcome.report["timings"]  # refused at the pre-flight: no connection was tried
    assert not (job_dir / "store").exists()
    job = load_job(_write(job_dir, JOB + "scheduler: tcp://127.0.0.1:8786\n"))
    assert preflight(job).job.scheduler == "tcp://127.0.0.1:8786"  # an address; whether it answers is for fit


def test_a_number_yaml_reads_as_text_is_named_and_the_preflights_scratch_store_is_not_logged(job_dir, caplog):
    """``lr: 1e-3`` is text to PyYAML: fit's refusal says how to write it. The pre-flight checks fit's options
    on a scratch store when the job's is not there yet: only the job's own store is logged as created."""
    with pytest.raises(
        JobFileError, match=r"got '1e-3'; YAML reads 1e-3 \(fit\.lr\) as text: write 1\.0e-3 or 0\.001$"
    ):
        preflight(load_job(_edit(job_dir, "lr: 0.05", "lr: 1e-3", "other.yaml")))
    with pytest.raises(JobFileError, match=r"fit\.stopping: .*'min_delta'$"):  # not about a number: no hint
        load_job(_edit(job_dir, "lr: 0.05", "lr: 0.05, stopping: {min_delta: 1e-4}", "other.yaml"))
    caplog.set_level("INFO")
    preflight(load_job(job_dir / "job.yaml"))
    created = [r.getMessage() for r in caplog.records if "created a new vcdask store" in r.getMessage()]
    assert created == [f"created a new vcdask store at local directory '{job_dir / 'store'}'"], created


def test_a_store_or_data_that_does_not_answer_is_a_failure_not_a_bad_job_file(job_dir, monkeypatch):
    """Connection refused (or a timeout, or access denied) is exit 1, as ``vcdask runs`` on the same store
    says: the same job passes once the store answers. A store or data file that is not there stays exit 2."""
    import socket

    from vcdask.errors import StoreUnreachableError
    from vcdask.jobs._preflight import _read

    with socket.socket() as s:  # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = f"{{endpoint_url: 'http://127.0.0.1:{port}', region: us-east-1, allow_http: true, max_tries: 1}}"
    down = _edit(job_dir, "store: store", f"store: {{location: 's3://bucket/runs', storage_options: {options}}}")
    with pytest.raises(StoreUnreachableError, match=r"could not be reached"):
        preflight(load_job(down))
    outcome = run_job(down)
    assert outcome.exit_code == EXIT_FAILED and outcome.message.startswith("StoreUnreachableError: "), outcome.message

    job = load_job(_edit(job_dir, "{path: train.zarr, features: x, label: y}", "{path: train.csv, label: target}"))
    errors = [ConnectionRefusedError(111, "Connection refused"), TimeoutError("timed out"), FileNotFoundError("gone")]

    def read_csv(*args, **kwargs):
        raise errors[0]

    monkeypatch.setattr("pandas.read_csv", read_csv)
    while len(errors) > 1:  # the data's server refused or did not answer: exit 1
        with pytest.raises(OSError, match=r"cannot read .*train\.csv \(the job's data:\) as csv: ") as info:
            _read(job, "data", job.data)
        assert not isinstance(info.value, JobFileError) and info.value.__cause__ is errors.pop(0)
    with pytest.raises(JobFileError, match=r"job\.yaml: data: cannot read .*train\.csv as csv: gone"):
        _read(job, "data", job.data)  # not there: exit 2


def test_a_csv_files_storage_options_read_it_and_are_not_given_to_fit(job_dir):
    """pandas reads a CSV URL with the job's storage_options; fit gets the DataFrame, which would ignore them
    (fit refuses storage_options with data in memory).  The preflight runs fit's checks with the job's keywords."""
    url = f"file://{job_dir / 'train.csv'}"
    text = f"""
    model: mymodels:make
    data: {{path: '{url}', label: target, storage_options: {{auto_mkdir: false}}}}
    validation: 0.25
    store: store
    fit: {{max_epochs: 1}}
    """
    job = load_job(_write(job_dir, text))
    assert job.data.storage_options == {"auto_mkdir": False}
    prepared = preflight(job)
    assert len(prepared.data) == 240
    assert "storage_options" not in fit_kwargs(prepared)


def test_run_job_with_a_bad_job_file_reports_exit_2(job_dir):
    outcome = run_job(_edit(job_dir, "max_epochs: 2", "max_epoch: 2"))
    assert outcome.exit_code == EXIT_BAD_JOB
    assert outcome.message.startswith("job.yaml: fit.max_epoch: unknown option; valid: ")
    assert "wait" not in outcome.message.split("valid: ")[1].split(", ")  # not offered as valid
    report = json.loads((job_dir / "reports" / "report.json").read_text())
    assert report["exit_code"] == 2 and report["released"] is False and "fit.max_epoch" in report["error"]
    assert not (job_dir / "store").exists()  # nothing was created
    outcome = run_job(_edit(job_dir, "max_epochs: 2", "max_epochs: 2, wait: false"))
    assert outcome.exit_code == EXIT_BAD_JOB and outcome.message.startswith(
        "job.yaml: fit.wait: not an option of a job"
    )
    assert "fit.wait" in json.loads((job_dir / "reports" / "report.json").read_text())["error"]
    assert not (job_dir / "store").exists()


def test_the_report_location_is_checked_at_the_preflight(job_dir, monkeypatch):
    """A report that cannot be written is a bad job file (exit 2) before any training, not exit 1 after a
    release (which a retry on exit 1 would train and release again); its missing folders are created."""
    import os

    for report, problem in (
        ("train.csv/r.json", r"report: .*train\.csv is a file, not a folder; the report goes to .*r\.json$"),
        ("reports/a.csv/b/r.json", r"report: .*a\.csv is a file, not a folder"),
        ("val.zarr", r"report: .*val\.zarr is a folder; name a file in it, e.g. .*val\.zarr/report\.json$"),
    ):
        (job_dir / "reports").mkdir(exist_ok=True)
        (job_dir / "reports" / "a.csv").write_text("")
        path = _edit(job_dir, "report: reports/report.json", f"report: {report}")
        with pytest.raises(JobFileError, match=problem):
            preflight(load_job(path))
        outcome = run_job(path)
        assert outcome.exit_code == EXIT_BAD_JOB and re.search(problem, outcome.message), outcome.message
    assert not (job_dir / "store").exists()
    (job_dir / "locked").mkdir(mode=0o555)
    with monkeypatch.context() as m:
        if os.geteuid() == 0:  # root writes in a read-only folder: refused as it would refuse another user

            def refused(*args, dir, **kwargs):
                raise PermissionError(13, "Permission denied", str(dir))

            m.setattr("tempfile.NamedTemporaryFile", refused)
        with pytest.raises(JobFileError, match=r"report: cannot write the report to .*locked/r\.json: Permission"):
            preflight(load_job(_edit(job_dir, "report: reports/report.json", "report: locked/r.json")))
    preflight(load_job(_edit(job_dir, "report: reports/report.json", "report: out/nightly/r.json")))
    assert list((job_dir / "out").rglob("*")) == [job_dir / "out" / "nightly"]  # the folder, and nothing in it


def test_a_job_refused_at_the_preflight_creates_no_store(job_dir):
    """The store is created only once every check has passed: a job whose options fit refuses, or whose
    model does not build, leaves nothing behind; one that passes creates it (a first release needs none)."""
    for old, new in (("lr: 0.05", "lr: -1"), ("hidden: 16", "width: 16"), ("metric: accuracy", "metric: mae")):
        outcome = run_job(_edit(job_dir, old, new))
        assert outcome.exit_code == EXIT_BAD_JOB, outcome.message
        assert not (job_dir / "store").exists(), outcome.message
    (job_dir / "notes").mkdir()
    (job_dir / "notes" / "todo.txt").write_text("not a store")
    with pytest.raises(JobFileError, match=r"job\.yaml: store: .*notes' exists but is not a vcdask store"):
        preflight(load_job(_edit(job_dir, "store: store", "store: notes")))
    prepared = preflight(load_job(_write(job_dir, JOB)))  # start: last-release, with no store yet: a fresh model
    assert prepared.start is None and prepared.store.writable and prepared.store.tags() == {}
    assert prepared.store.location == str(job_dir / "store") and (job_dir / "store").is_dir()


def test_preflight_runs_fits_checks_and_knows_the_runs_metrics(job_dir):
    # the labels are integers (a classifier): the run computes loss and accuracy, so mae is refused before training
    with pytest.raises(JobFileError) as info:
        preflight(load_job(_edit(job_dir, "metric: accuracy", "metric: mae")))
    assert info.value.field == "release.metric"
    assert "the run computes no 'mae'; it computes ['loss', 'accuracy']; name it under fit.metrics" in str(info.value)
    assert preflight(load_job(_edit(job_dir, "fit: {", "fit: {metrics: [accuracy, mae], "))).job.release.mode == "max"
    # every check of vcdask.fit runs in preflight: a bad option is exit 2, with nothing trained
    outcome = run_job(_edit(job_dir, "lr: 0.05", "lr: -1"))
    assert outcome.exit_code == EXIT_BAD_JOB
    assert outcome.message == "job.yaml: fit: rejected by vcdask.fit: lr must be a positive number, got -1"
    outcome = run_job(_edit(job_dir, "lr: 0.05", "lr: 0.05, patience: 0"))
    assert outcome.exit_code == EXIT_BAD_JOB and "patience must be an integer >= 1, got 0" in outcome.message
    assert not [b for b in vcdask.open_store(job_dir / "store", mode="r").branches() if b.startswith("run-")]


def test_release_mode_follows_the_one_lower_is_better_rule(job_dir):
    from vcdask.engine.policy import lower_is_better

    named = "fit: {metrics: [accuracy, mae, rmse, val_loss, f1], max_epochs: 2, lr: 0.05}"
    for metric in ("loss", "mae", "accuracy", "rmse", "val_loss", "f1"):
        text = JOB.replace("metric: accuracy", f"metric: {metric}").replace("fit: {max_epochs: 2, lr: 0.05}", named)
        rule = load_job(_write(job_dir, text)).release
        assert rule.mode == ("min" if lower_is_better(metric) else "max"), metric


_CORE_ONLY = r"""
import importlib.metadata as md, json, re, sys, tomllib
from vcdask.jobs import load_job, preflight
preflight(load_job(sys.argv[1]))
with open(sys.argv[2], "rb") as f:  # the dependencies a clean install gets: pyproject.toml's, not the venv's
    todo = tomllib.load(f)["project"]["dependencies"]

def parse(req):
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[([^\]]*)\])?", req)
    return m.group(1).lower().replace("_", "-"), {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}

core = sorted(parse(r)[0] for r in todo)
allowed, optional = set(), set()  # what an install brings; what an allowed package imports only if it is there
while todo:
    name, extras = parse(todo.pop())
    key = (name, frozenset(extras))
    if key in allowed:
        continue
    allowed.add(key)
    try:
        reqs = md.requires(name) or []
    except md.PackageNotFoundError:
        continue
    for r in reqs:
        extra = re.search(r"extra\s*==\s*\W([\w.\-]+)", r)
        if extra is None or extra.group(1) in extras:
            todo.append(r.split(";")[0])
        else:
            optional.add(parse(r)[0])
names = {n for n, _ in allowed}
more = list(optional)  # and all those could bring, extras too (jsonschema's format extras: arrow, lark, regex)
while more:
    try:
        reqs = md.requires(more.pop()) or []
    except md.PackageNotFoundError:
        continue
    for name in {parse(r)[0] for r in reqs} - optional:
        optional.add(name)
        more.append(name)
owners = md.packages_distributions()
used = {d.lower().replace("_", "-") for m in list(sys.modules) for d in owners.get(m.partition(".")[0], [])}
print(json.dumps({"core": core, "outside": sorted(used - names - optional - {"vcdask"})}))
"""


def test_jobs_need_nothing_outside_the_core_dependencies(job_dir):
    """``vcdask train`` on a clean install: reading, validating (JSON Schema) and checking a job imports only
    distributions that the package's own dependencies bring (not the test extras)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CORE_ONLY, str(job_dir / "job.yaml"), str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert "jsonschema" in found["core"] and "pyyaml" in found["core"]
    assert found["outside"] == [], f"vcdask.jobs imports {found['outside']}, which no core dependency brings"


# -- two scheduled runs, as cron would start them -------------------------------------------------------------
def _train(job: Path, expect: int) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "vcdask.cli", "train", job.name],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=job.parent,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == expect, f"exit code {proc.returncode}, expected {expect}:\n{output}"
    return output


def test_two_scheduled_runs_release_only_when_better(job_dir, cluster, capsys):
    # 1. the embedded default, from a fresh model, deliberately weak (1 epoch at lr 1e-5): the first release
    weak = _edit(job_dir, "fit: {max_epochs: 2, lr: 0.05}", "fit: {max_epochs: 1, lr: 0.00001}", "weak.yaml")
    out = _train(weak, expect=0)
    first = json.loads((job_dir / "reports" / "report.json").read_text())
    assert first["start"] is None and first["released"] is True and first["release"]["tag"] == "nightly-1"
    assert f"released nightly-1 = version {first['version']}: first release" in out
    # the candidate was scored here, on the run's validation data with the run's metric: as the run scored it
    assert first["release"]["candidate"] == pytest.approx(first["run_metrics"]["accuracy"], abs=1e-6)
    assert first["settings"]["optimizer_state"] in ("fresh", "worker") and first["settings"]["n_shards"] >= 2
    store = vcdask.open_store(job_dir / "store", mode="r")
    assert store.tags() == {"nightly-1": first["version"]}
    scheduler = f"scheduler: {cluster[0].scheduler_address}\n"

    # 2. on a running scheduler, warm-started from nightly-1, trained properly: better, so released as nightly-2
    out = _train(_write(job_dir, JOB + scheduler, "job2.yaml"), expect=0)
    second = json.loads((job_dir / "reports" / "report.json").read_text())
    assert second["start"] == {"kind": "last-release", "tag": "nightly-1", "version": first["version"], "branch": None}
    assert second["recorded_start"]["tag"] == "nightly-1"  # the run itself recorded where it started
    assert second["recorded_start"]["version"] == first["version"]
    initial = store.versions(second["run_id"])[-1]
    assert initial.metadata["start"]["tag"] == "nightly-1"
    release = second["release"]
    assert release["baseline_tag"] == "nightly-1" and release["baseline_version"] == first["version"]
    # the release was scored again on this run's validation data: here the same data, so the same number
    assert release["baseline"] == pytest.approx(first["release"]["candidate"], abs=1e-6)
    assert release["candidate"] > 0.75 and release["candidate"] - release["baseline"] > 0.1  # learned: better
    assert second["released"] is True and release["tag"] == "nightly-2"
    assert f"released nightly-2 = version {second['version']}: accuracy" in out and "beats nightly-1" in out
    assert store.tags() == {"nightly-1": first["version"], "nightly-2": second["version"]}
    record = json.loads(store.files.get(f"{second['run_id']}/job.json"))  # recorded beside the run, then tagged
    assert record["released"] is True and record["release"]["tag"] == "nightly-2"

    # 3. from nightly-2, with a gain no accuracy can reach over it (> 0.5 from > 0.75): exit 3, nothing tagged
    text = JOB.replace("tag_prefix: nightly-}", "tag_prefix: nightly-, min_delta: 0.5}") + scheduler
    out = _train(_write(job_dir, text, "job3.yaml"), expect=3)
    third = json.loads((job_dir / "reports" / "report.json").read_text())
    assert third["start"]["tag"] == "nightly-2" and third["release"]["baseline_tag"] == "nightly-2"
    assert third["released"] is False and "nightly-2 stays the newest release" in third["reason"]
    assert "not released: accuracy" in out
    assert store.tags() == {"nightly-1": first["version"], "nightly-2": second["version"]}
    assert store.head(third["run_id"]) == third["version"]  # the candidate stays on its branch

    # 4. another job released nightly-3 between our look at the tags and our tag: compare with it, then decide
    prepared = preflight(load_job(_write(job_dir, JOB.replace("tag_prefix: nightly-}", "tag_prefix: rival-}"))))
    spec = load_spec(prepared.store, second["run_id"])
    scores = score(spec, {"c": vcdask.load(prepared.store, version=second["version"])})["c"]
    prepared.store.tag("rival-1", first["version"])
    report: dict = {}
    assert _compare(prepared, report, second["run_id"], second["version"], spec, scores, 0, None) is None
    assert report["released"] is False and "rival-1 was released by another job first" in report["reason"]
    assert _release(prepared, report, second["run_id"], second["version"], spec, scores) == 0
    assert report["release"]["baseline_tag"] == "rival-1" and report["release"]["tag"] == "rival-2"
    assert prepared.store.tags()["rival-2"] == second["version"]
    assert json.loads(prepared.store.files.get(f"{second['run_id']}/job.json"))["release"]["tag"] == "rival-2"
    # the release scores cast the rows as training, validation and predict do: one rule (vcdask.batches)
    floats, ints = torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.int64)
    assert cast_like_training(floats, spec).dtype == spec.x_dtype == torch.float32
    assert cast_like_training(ints, spec).dtype == torch.float32  # cast_x: the model takes floats
    assert cast_like_training(ints, dataclasses.replace(spec, cast_x=False)).dtype == torch.int64  # an embedding
    assert cast_like_training(torch.zeros(2, dtype=torch.int32), spec, "y").dtype == torch.int64  # class labels

    # 5. a bad job file: exit 2 before any work, one line naming the field, no traceback
    out = _train(_edit(job_dir, "lr: 0.05", "lr: 0.05, max_epoch: 3", "bad.yaml"), expect=2)
    assert "vcdask train: bad.yaml: fit.max_epoch: unknown option; valid: " in out
    assert "Traceback" not in out
    runs = [b for b in vcdask.open_store(job_dir / "store", mode="r").branches() if b.startswith("run-")]
    assert sorted(runs) == sorted([first["run_id"], second["run_id"], third["run_id"]])  # the bad job started none

    # 6. `vcdask runs` reads each run's job record: its metric, where it started, what it released
    from vcdask.cli import main

    capsys.readouterr()
    assert main(["runs", str(job_dir / "store")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(third["run_id"]) and lines[1].endswith("tag nightly-2")
    assert f"accuracy={third['release']['candidate']:.4g}" in lines[1]
    assert lines[2].startswith(second["run_id"]) and lines[2].endswith("tag nightly-1  released rival-2")
    assert lines[3].startswith(first["run_id"]) and lines[3].endswith("fresh  released nightly-1")

    # 7. a release that scores NaN (a model an old release merged badly) is beaten by any candidate that scores a
    # number: it blocked every later release, each job ending "not better"; the record and report hold null, not NaN
    broken = vcdask.load(prepared.store, version=second["version"])
    with torch.no_grad():
        next(broken.parameters()).fill_(float("nan"))
    prepared.store.create_branch("broken", second["version"])
    prepared.store.tag("broken-1", prepared.store.commit(broken, branch="broken"))
    text = JOB.replace("tag_prefix: nightly-}", "tag_prefix: broken-}").replace("start: last-release\n", "")
    text = text.replace("metric: accuracy", "metric: loss")  # (NaN outputs: a loss of NaN; an accuracy of class 0)
    nan_job = _write(job_dir, text, "broken.yaml")  # (a fresh model: a start from broken-1 is refused, named)
    prepared = preflight(load_job(nan_job))
    report = {}
    assert _compare(prepared, report, second["run_id"], second["version"], spec, scores, 1, "broken-1") == 0
    assert report["released"] is True and "is a number, broken-1's is nan" in report["reason"]
    record = prepared.store.files.get(f"{second['run_id']}/job.json").decode()
    assert "NaN" not in record and json.loads(record)["release"]["baseline"] is None
    # a job that starts from the broken release is refused naming its start, not its model
    with pytest.raises(JobFileError, match=r"broken\.yaml: start: rejected by vcdask\.fit: the model's parameters"):
        preflight(load_job(_write(job_dir, text + "start: {tag: broken-1}\n", "broken.yaml")))


def test_csv_data_with_a_held_out_fraction_on_a_threaded_scheduler(job_dir):
    """The pandas path, in-process: a CSV file as a DataFrame with label=, validation=0.25, a loss rule (min)."""
    from distributed import LocalCluster

    text = """
    model: mymodels:make
    data: {path: train.csv, label: target}
    validation: 0.25
    store: store
    start: last-release
    fit: {max_epochs: 2, lr: 0.05}
    release: {metric: loss, tag_prefix: csv-}
    report: report.json
    """
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cl:
        text = textwrap.dedent(text) + f"scheduler: {cl.scheduler_address}\n"
        weak = _write(job_dir, text.replace("max_epochs: 2, lr: 0.05", "max_epochs: 1, lr: 0.00001"), "weak.yaml")
        first = run_job(weak)  # deliberately weak: the first release
        assert first.exit_code == 0, first.message
        assert first.report["release"]["tag"] == "csv-1" and first.report["release"]["mode"] == "min"
        assert first.report["release"]["candidate"] == pytest.approx(first.report["run_metrics"]["loss"], rel=1e-5)
        second = run_job(_write(job_dir, text))
    assert second.exit_code == 0, second.message
    assert second.report["start"]["tag"] == "csv-1"
    release = second.report["release"]
    # the same held-out rows (the seeded split) score csv-1 as its own run did
    assert release["baseline"] == pytest.approx(first.report["release"]["candidate"], rel=1e-5)
    assert release["baseline"] - release["candidate"] > 0.05 and second.report["released"] is True  # lower loss
    tags = vcdask.open_store(job_dir / "store", mode="r").tags()
    assert tags == {"csv-1": first.report["version"], "csv-2": second.report["version"]}


@pytest.mark.slow
def test_sigterm_stops_a_job_as_ctrl_c_does(job_dir):
    """SIGTERM (cron's timeout, systemd, Kubernetes stopping a pod) ends a job as Ctrl-C ends fit: the run
    stopped with its merged work committed, nothing released, exit 130, the report saying so and naming the
    run. Another SIGTERM once the report is written (the job closing its cluster) does not change the exit
    code to 143: the process exits as its report says."""
    from vcdask.cli._listing import run_info

    job = _edit(job_dir, "fit: {max_epochs: 2, lr: 0.05}", "fit: {max_epochs: 2000, lr: 0.05}", "long.yaml")
    where = job_dir / "reports" / "report.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vcdask.cli", "train", job.name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=job.parent,
    )  # fmt: skip
    try:
        run_id = wait_for_merges(job_dir / "store", proc)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 120
        while not where.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        again = proc.poll() is None  # the report is written; the job is closing its cluster
        if again:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out + err
    assert "interrupted (Ctrl-C or SIGTERM)" in err and "close_embedded()" not in err, err[-3000:]
    assert again and "vcdask: SIGTERM ignored: the job has ended" in err, err[-3000:]
    report = json.loads(where.read_text())
    assert report["exit_code"] == 130 and report["released"] is False and report["run_id"] == run_id
    assert f"run {run_id} was stopped" in report["error"] and f"vcdask.resume('{run_id}'" in report["error"]
    info = run_info(vcdask.open_store(job_dir / "store", mode="r"), run_id)
    assert info["status"].startswith("stopped") and info["step"] >= 3, info


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_timeout_to_the_whole_process_group_stops_the_run_promptly(job_dir, sig):
    """Ctrl-C in a terminal and ``timeout -s TERM`` signal the whole process group, the embedded cluster's
    worker processes too: they ignore it (the job stops its run and closes them itself), so the run's last
    validation runs and the run is recorded as stopped within seconds, not after the whole interrupt grace
    (60 s) with the run left incomplete."""
    from vcdask.cli._listing import run_info

    job = _edit(job_dir, "fit: {max_epochs: 2, lr: 0.05}", "fit: {max_epochs: 2000, lr: 0.05}", "long.yaml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vcdask.cli", "train", job.name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=job.parent, start_new_session=True,
    )  # fmt: skip
    try:
        run_id = wait_for_merges(job_dir / "store", proc)
        os.killpg(proc.pid, sig)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out + err
    assert took < 30, f"{took:.0f} s after the signal:\n{err[-3000:]}"
    info = run_info(vcdask.open_store(job_dir / "store", mode="r"), run_id)
    assert info["status"].startswith("stopped"), (info, err[-3000:])
    assert json.loads((job_dir / "reports" / "report.json").read_text())["run_id"] == run_id


@pytest.mark.slow
def test_a_run_that_has_not_ended_within_the_interrupt_grace_is_not_reported_as_stopped(job_dir):
    """With no grace (``vcdask.interrupt-grace: 0``) the job leaves before its run has ended: the report says
    that it was told to stop, not that it was stopped with its work committed."""
    job = _edit(job_dir, "fit: {max_epochs: 2, lr: 0.05}", "fit: {max_epochs: 2000, lr: 0.05}", "long.yaml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vcdask.cli", "train", job.name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=job.parent,
        env={**os.environ, "DASK_VCDASK__INTERRUPT_GRACE": "0"},
    )  # fmt: skip
    try:
        run_id = wait_for_merges(job_dir / "store", proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out + err
    report = json.loads((job_dir / "reports" / "report.json").read_text())
    assert report["run_id"] == run_id and report["run_status"] not in ("finished", "error", "cancelled"), report
    assert f"run {run_id} was told to stop but had not ended when the job left" in report["error"]


FAILING = """
import torch

class FailsInTraining(torch.nn.Linear):
    def forward(self, x):
        if self.training and torch.is_grad_enabled():  # the pre-flight's checks pass; the run's shards fail
            raise RuntimeError("fails in training")
        return super().forward(x)

def trains_and_fails(**kwargs):
    return torch.nn.Sequential(FailsInTraining(4, 2))
"""


def test_a_job_stopped_before_its_run_or_whose_run_failed_says_so(job_dir, cluster):
    """SIGTERM during the pre-flight: exit 130, the report saying that no run started; the job's handlers
    are gone once it returns. A run that fails on the cluster: exit 1, the report naming the run."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    outcome = run_job(_edit(job_dir, "mymodels:make", "mymodels:stopped_while_built"))
    assert outcome.exit_code == 130 and isinstance(outcome.error, KeyboardInterrupt), outcome.message
    assert outcome.message == "interrupted (Ctrl-C or SIGTERM) before a run started: nothing trained, nothing released"
    assert (
        "run_id" not in outcome.report and (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    )

    # a module of its own: the workers unpickle the model by value from the module beside this job file
    (job_dir / "failing.py").write_text(FAILING)
    text = JOB.replace("mymodels:make", "failing:trains_and_fails").replace("model_args: {hidden: 16}\n", "")
    outcome = run_job(_write(job_dir, text + f"scheduler: {cluster[0].scheduler_address}\n"))
    assert outcome.exit_code == EXIT_FAILED and "fails in training" in outcome.message, outcome.message
    report = json.loads((job_dir / "reports" / "report.json").read_text())
    run_id = report["run_id"]
    assert outcome.message.startswith(f"RunFailedError: run {run_id} ended with status 'error'")
    assert run_id in vcdask.open_store(job_dir / "store", mode="r").branches()


MOVES_THE_REPORT_FOLDER = """
import os
import torch

class MovesTheReportFolder(torch.nn.Linear):
    def forward(self, x):
        if self.training and torch.is_grad_enabled() and os.path.isdir({reports!r}):  # a shard, not the pre-flight
            try:
                os.rename({reports!r}, {moved!r})
                with open({reports!r}, "w"):
                    pass
            except OSError:  # (the other worker did it first)
                pass
        return super().forward(x)

def make(**kwargs):
    return torch.nn.Sequential(MovesTheReportFolder(4, 2))
"""


def test_a_report_whose_place_changed_while_the_job_trained_is_named_with_what_the_job_did(job_dir, cluster):
    """The report's folder checked at the pre-flight was replaced by a file while the run trained (by the model's
    own shards, here): the job's line says that the report was not written, and what the job did."""
    reports = job_dir / "reports"
    reports.mkdir()
    (job_dir / "moving.py").write_text(
        MOVES_THE_REPORT_FOLDER.format(reports=str(reports), moved=str(job_dir / "moved"))
    )
    text = JOB.replace("mymodels:make", "moving:make").replace("model_args: {hidden: 16}\n", "")
    outcome = run_job(_write(job_dir, text + f"scheduler: {cluster[0].scheduler_address}\n"))
    assert reports.is_file() and (job_dir / "moved").is_dir(), "the model's shards did not move the folder"
    assert outcome.exit_code == EXIT_FAILED and outcome.message.startswith(
        f"could not write the report to {reports / 'report.json'}: "
    ), outcome.message
    tags = vcdask.open_store(job_dir / "store", mode="r").tags()
    assert list(tags) == ["nightly-1"]  # (a first release)
    assert outcome.message.endswith(f"(the job itself: {outcome.report['reason']})"), outcome.message
    assert outcome.report["reason"].startswith(f"released nightly-1 = version {tags['nightly-1']}")


def test_a_report_is_written_whole_or_not_at_all(tmp_path):
    """A monitor reading the report while the job writes it, or a job killed as it writes, never sees half
    of one: the old report stays until the new one is complete."""
    from vcdask.jobs._run import _write_whole

    where = tmp_path / "reports" / "report.json"
    _write_whole(where, '{"exit_code": 0}\n')
    assert where.read_text() == '{"exit_code": 0}\n'
    with pytest.raises(UnicodeEncodeError):
        _write_whole(where, '{"error": "\ud800"}\n')  # a lone surrogate: the write fails half way
    assert where.read_text() == '{"exit_code": 0}\n'
    assert [p.name for p in where.parent.iterdir()] == ["report.json"]
    # a report path that is a link is written through, the link kept (as open(path, "w") does)
    target = tmp_path / "served" / "latest.json"
    target.parent.mkdir()
    target.write_text("old")
    (tmp_path / "link.json").symlink_to(target)
    _write_whole(tmp_path / "link.json", "new")
    assert (tmp_path / "link.json").is_symlink() and target.read_text() == "new"
    with pytest.raises(IsADirectoryError):
        _write_whole(tmp_path / "served", "x")
    names = ["latest.json", "link.json", "report.json", "reports", "served"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == names  # (no temporary file left)
    # a report made private stays private when written again
    target.chmod(0o600)
    _write_whole(tmp_path / "link.json", "newer")
    assert target.stat().st_mode & 0o777 == 0o600 and target.read_text() == "newer"
