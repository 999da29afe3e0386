"""Secrets never travel: a run on an S3 store opened with explicit credentials writes them nowhere.

The store, the run's spec, its staged data, its updates and versions are all in the bucket: the test reads
every object back and looks for the secret (issue 10: it used to be written into ``runs/<run>/spec.pkl``).
"""

from __future__ import annotations

import secrets
import time

import pytest
import torch
from env_helpers import spawned_cluster

import vcdask
from vcdask.errors import StoreCredentialsError

pytestmark = [pytest.mark.s3, pytest.mark.cluster, pytest.mark.slow]


def _tiny(digits_data):
    (X_train, y_train), _ = digits_data
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    return model, (X_train[:400], y_train[:400])


def test_fit_on_s3_writes_no_secret_anywhere(s3, digits_data):
    secret = f"SECRET-{secrets.token_hex(16)}"
    key_id = f"KEYID{secrets.token_hex(6).upper()}"
    bucket = s3.new_bucket()
    store = vcdask.open_store(
        f"s3://{bucket}/vc",
        endpoint_url=s3.endpoint_url,
        region="us-east-1",
        access_key_id=key_id,
        secret_access_key=secret,
    )
    model, data = _tiny(digits_data)
    # the embedded cluster (our own processes) is given the credentials; nothing else carries them
    result = vcdask.fit(
        model, data, store=store, max_epochs=2, n_shards=3, validation=0.2, keep_updates=True, progress=False
    )
    assert len(result.epochs) == 2 and result.history.outcome.eq("merged").sum() == 6 and "accuracy" in result.metrics

    client = s3.client()
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]
    assert any(k.endswith("/spec.pkl") for k in keys), keys
    assert any("/updates/" in k for k in keys), keys  # kept: they are read too
    assert any(k.startswith("vc/snapshots/") for k in keys), keys
    assert len(keys) > 20
    for key in keys:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert secret.encode() not in body, key
        assert key_id.encode() not in body, key
    for text in (
        repr(store),
        repr(result.store),
        result.history.to_string(),
        result._repr_html_(),
        repr(result),
        result.workers.to_string(),
    ):
        assert secret not in text and key_id not in text


def test_a_cluster_without_credentials_is_told_how_to_get_them(s3, digits_data, no_aws_credentials):
    """A store opened with explicit secrets, a cluster whose workers have none: a clear error before the
    run starts, naming the remedies; nothing is written to the bucket."""
    from distributed import Client

    bucket = s3.new_bucket()
    store = vcdask.open_store(
        f"s3://{bucket}/vc",
        endpoint_url=s3.endpoint_url,
        region="us-east-1",
        access_key_id="KEYID",
        secret_access_key="not-in-the-workers-env",
    )
    model, data = _tiny(digits_data)
    with spawned_cluster() as cluster, Client(cluster, set_as_default=False) as c:
        with pytest.raises(StoreCredentialsError, match="share_credentials") as info:
            vcdask.fit(model, data, store=store, client=c, max_epochs=1, n_shards=2, progress=False)
    assert "not-in-the-workers-env" not in str(info.value)
    runs = [b for b in store.branches() if b.startswith("run-")]
    assert runs == []  # refused before any branch, spec or data was written


def test_a_cluster_without_the_credentials_this_process_has_is_told_before_the_run(
    s3, digits_data, no_aws_credentials, monkeypatch
):
    """A store holding no secrets (this process has credentials in its environment), a cluster of the caller's
    whose workers have none: the same clear error before the run starts, not every task failing on the
    workers until the run gives up."""
    from distributed import Client

    bucket = s3.new_bucket()
    model, data = _tiny(digits_data)
    with spawned_cluster() as cluster, Client(cluster, set_as_default=False) as c:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # (this process only: its workers have started)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        store = vcdask.open_store(f"s3://{bucket}/vc", endpoint_url=s3.endpoint_url, region="us-east-1")
        assert not vcdask.store.store_holds_secrets(store)
        t0 = time.perf_counter()
        with pytest.raises(StoreCredentialsError, match="AWS_ACCESS_KEY_ID") as info:
            vcdask.fit(model, data, store=store, client=c, max_epochs=1, n_shards=2, progress=False)
        assert time.perf_counter() - t0 < 30
    assert "1 of 2 processes" in str(info.value)  # (the worker; the scheduler runs in this process)
    assert [b for b in store.branches() if b.startswith("run-")] == []
