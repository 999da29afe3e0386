"""Secrets never travel in a location or an endpoint: ``s3://KEY:SECRET@bucket/p`` and
``endpoint_url="http://user:SECRET@host"`` are refused (``InvalidLocationError``) with the credentials masked,
before anything is opened; and a job file's schema errors under ``storage_options`` never show the values."""

from __future__ import annotations

import json
import pickle
import secrets
import textwrap
from pathlib import Path

import pytest

import vcdask
from vcdask.errors import InvalidLocationError
from vcdask.jobs import EXIT_BAD_JOB, JobFileError, load_job, run_job
from vcdask.store._schemes import backend_for

SECRET = f"SECRET{secrets.token_hex(12)}"
KEY_ID = f"KEYID{secrets.token_hex(6).upper()}"


def _refused(location, **options) -> str:
    """The refusal of the backend for ``location`` (made, not opened: nothing reaches the network, even where a
    refusal is missing: a GCS or Azure location would be opened on the internet)."""
    with pytest.raises(InvalidLocationError) as info:
        backend_for(location, "a", options)
    message = str(info.value)
    assert SECRET not in message and KEY_ID not in message, message
    return message


# -- locations ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("location", "options", "shown"),
    [
        (f"s3://{KEY_ID}:{SECRET}@bucket/p", {"endpoint_url": "http://127.0.0.1:9"}, "'s3://***@bucket/p'"),
        (f"s3://{KEY_ID}:abc/{SECRET}@bucket/p", {"endpoint_url": "http://127.0.0.1:9"}, "'s3://***@bucket/p'"),
        (f"s3://{SECRET}@bucket/p", {"endpoint_url": "http://127.0.0.1:9"}, "'s3://***@bucket/p'"),
        (f"gs://{KEY_ID}:{SECRET}@bucket/p", {}, "'gs://***@bucket/p'"),
        (f"az://{KEY_ID}:{SECRET}@container/p", {"account": "acct"}, "'az://***@container/p'"),
    ],
    ids=["s3", "s3-secret-with-slash", "s3-token-only", "gcs", "azure"],
)
def test_a_location_with_credentials_is_refused_masked(location, options, shown):
    message = _refused(location, **options)
    assert shown in message and "holds credentials" in message


def test_open_store_refuses_it_before_opening_anything():
    with pytest.raises(InvalidLocationError, match=r"'s3://\*\*\*@bucket/p' holds credentials") as info:
        vcdask.open_store(f"s3://{KEY_ID}:{SECRET}@bucket/p", endpoint_url="http://127.0.0.1:9")
    assert SECRET not in str(info.value) and KEY_ID not in str(info.value)


def test_a_file_url_naming_a_host_with_credentials_is_named_masked():
    message = _refused(f"file://{KEY_ID}:{SECRET}@host/p")
    assert "'file://***@host/p' names the host '***@host'" in message


def test_a_location_of_no_known_scheme_is_named_masked():
    message = _refused(f"http://{KEY_ID}:{SECRET}@127.0.0.1:9/p")
    assert "'http://***@127.0.0.1:9/p'" in message and "unsupported store location scheme" in message


# -- endpoints ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("location", "options", "named"),
    [
        ("s3://bucket/p", {"endpoint_url": f"http://user:{SECRET}@127.0.0.1:9"}, "['endpoint_url']"),
        ("s3://bucket/p", {"endpoint": f"http://user:{SECRET}@127.0.0.1:9"}, "['endpoint']"),
        (
            "s3://bucket/p",
            {"client_kwargs": {"endpoint_url": f"http://{SECRET}@127.0.0.1:9"}},
            "['client_kwargs.endpoint_url']",
        ),  # fmt: skip
        (
            "az://container/p",
            {"account": "acct", "config": {"azure_storage_endpoint": f"http://u:{SECRET}@127.0.0.1:9"}},
            "['config.azure_storage_endpoint']",
        ),  # fmt: skip
        (
            "gs://bucket/p",
            {"config": {"google_base_url": f"https://u:{SECRET}@127.0.0.1:9"}},
            "['config.google_base_url']",
        ),  # fmt: skip
    ],
    ids=["endpoint_url", "alias", "client_kwargs", "azure-config", "gcs-config"],
)
def test_an_endpoint_with_credentials_is_refused(location, options, named):
    message = _refused(location, **options)
    assert named in message and "URLs with credentials" in message


def test_a_public_endpoint_is_still_public(s3):
    """An endpoint without credentials travels with the store and is shown, as before."""
    store = vcdask.open_store(f"s3://{s3.new_bucket()}/p", endpoint_url=s3.endpoint_url, access_key_id=KEY_ID,
                              secret_access_key=SECRET)  # fmt: skip
    assert s3.endpoint_url in store.describe()
    payload = pickle.dumps(store)
    assert s3.endpoint_url.encode() in payload and SECRET.encode() not in payload and KEY_ID.encode() not in payload


# -- job files ----------------------------------------------------------------------------------------------------
MODELS = """
import torch

def make():
    return torch.nn.Linear(4, 2)
"""


def _job(tmp_path: Path, text: str) -> Path:
    (tmp_path / "mymodels.py").write_text(MODELS)
    (tmp_path / "data.zarr").mkdir(exist_ok=True)
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(
    ("section", "field", "expected"),
    [
        (
            f"""
         data: data.zarr
         store:
           location: s3://bucket/p
           storage_options: "endpoint_url=http://127.0.0.1:9 secret={SECRET}"
         """,
            "store.storage_options",
            "must be a mapping",
        ),
        (
            f"""
         data: {{path: data.zarr, storage_options: [{SECRET}]}}
         store: store
         """,
            "data.storage_options",
            "must be a mapping",
        ),
        (
            f"""
         data: data.zarr
         validation: {{path: data.zarr, storage_options: "secret={SECRET}"}}
         store: store
         """,
            "validation.storage_options",
            "must be a mapping",
        ),
        (
            f"""
         data: data.zarr
         store: [s3://bucket/p, {{storage_options: {{secret: {SECRET}}}}}]
         """,
            "store",
            "is not valid here",
        ),
    ],
    ids=["store", "data", "validation", "store-one-of"],
)
def test_a_job_files_schema_errors_never_show_storage_options(tmp_path, section, field, expected):
    path = _job(tmp_path, "model: mymodels:make\n" + textwrap.dedent(section))
    with pytest.raises(JobFileError) as info:
        load_job(path)
    assert info.value.field == field and expected in str(info.value)
    assert SECRET not in str(info.value)


def test_a_validation_whose_storage_options_differ_is_named_without_them(tmp_path):
    path = _job(tmp_path, f"""
        model: mymodels:make
        data: {{path: s3://bucket/train.zarr, storage_options: {{secret: {SECRET}}}}}
        validation: {{path: s3://bucket/val.zarr, storage_options: {{profile: other}}}}
        store: store
        """)  # fmt: skip
    with pytest.raises(JobFileError, match=r"validation\.storage_options: must match data\.storage_options$") as info:
        load_job(path)
    assert SECRET not in str(info.value)


def test_a_jobs_store_location_with_credentials_is_in_no_report(tmp_path):
    """``vcdask train``: refused as a bad job file (exit 2), the credentials masked in its error and report."""
    path = _job(tmp_path, f"""
        model: mymodels:make
        data: data.zarr
        store:
          location: s3://{KEY_ID}:{SECRET}@bucket/p
          storage_options: {{endpoint_url: "http://127.0.0.1:9"}}
        report: report.json
        """)  # fmt: skip
    outcome = run_job(path)
    assert outcome.exit_code == EXIT_BAD_JOB
    report = (tmp_path / "report.json").read_text()
    assert "s3://***@bucket/p" in json.loads(report)["error"]
    for text in (report, outcome.message, str(outcome.error)):
        assert SECRET not in text and KEY_ID not in text
