"""Secrets a store was opened with stay in the process that opened it: never pickled, shown or written."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import uuid
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from chaos_helpers import worker_info

from vcdask import open_store
from vcdask.data import prepare_data
from vcdask.errors import InvalidLocationError, StoreAccessDeniedError, StoreCredentialsError
from vcdask.staging import stage
from vcdask.store import StoreCredentials, check_cluster_access, share_credentials, store_holds_secrets
from vcdask.store._credentials import forget_credentials, redact
from vcdask.store._errors import translate

pytestmark = pytest.mark.s3


# Where a process looks for AWS credentials besides these variables: nowhere, in these tests.
@pytest.fixture
def secret_store(s3):
    """A new S3 store opened with a unique key id and secret (moto accepts any); yields (store, key id, secret)."""
    key_id, secret = f"AKIA{uuid.uuid4().hex[:16].upper()}", f"secret-{uuid.uuid4().hex}"
    location = f"s3://{s3.new_bucket()}/params"
    store = open_store(location, endpoint_url=s3.endpoint_url, access_key_id=key_id, secret_access_key=secret)
    yield store, key_id, secret
    forget_credentials(location)


def _assert_clean(blob: bytes | str, *secrets: str) -> None:
    data = blob.encode() if isinstance(blob, str) else blob
    for secret in secrets:
        assert secret.encode() not in data


def test_pickle_and_repr_hold_no_secret(secret_store, s3):
    store, key_id, secret = secret_store
    v = store.commit({"w": torch.ones(3)})
    blob = pickle.dumps(store)
    _assert_clean(blob, key_id, secret)
    _assert_clean(repr(store) + store.describe() + repr(store.files.zarr_store("x.zarr")), key_id, secret)
    _assert_clean(pickle.dumps(store.files.zarr_store("x.zarr")), key_id, secret)
    assert s3.endpoint_url.encode() in blob  # the non-secret options do travel
    assert pickle.loads(blob).head() == v


def test_store_holds_secrets(secret_store, s3):
    store, _, _ = secret_store
    assert store_holds_secrets(store)
    from_env = open_store(store.location, endpoint_url=s3.endpoint_url)  # the fixture's environment variables
    assert not store_holds_secrets(from_env)
    assert not store_holds_secrets(store.location)
    assert not store_holds_secrets(open_store(f"memory://{uuid.uuid4().hex}"))


def test_unpickled_in_this_process_uses_the_registered_secrets(secret_store, no_aws_credentials):
    store, _, _ = secret_store
    clone = pickle.loads(pickle.dumps(store))  # an in-process scheduler or worker
    v = clone.commit({"w": torch.full((2,), 7.0)})
    assert store.read(v).state_dict()["w"].tolist() == [7.0, 7.0]


_CHILD = """
import pickle, sys
try:
    print(pickle.loads(sys.stdin.buffer.read()).head())
except Exception as e:
    print(type(e).__name__, e)
"""


def _unpickle_in_child(blob: bytes, env: dict) -> str:
    done = subprocess.run([sys.executable, "-c", _CHILD], input=blob, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip()


@pytest.mark.slow
def test_unpickled_in_a_fresh_process_uses_its_own_credentials(secret_store, no_aws_credentials):
    store, key_id, secret = secret_store
    v = store.commit({"w": torch.ones(3)})
    blob = pickle.dumps(store)
    with_env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    assert _unpickle_in_child(blob, with_env) == v
    out = _unpickle_in_child(blob, dict(os.environ))  # no credentials anywhere: a clear error, no secret
    assert out.startswith("StoreAccessDeniedError") and "no credentials" in out, out
    _assert_clean(out, key_id, secret)


def test_staged_data_carries_no_secret(secret_store, no_aws_credentials):
    store, key_id, secret = secret_store
    X, y = np.arange(40, dtype=np.float32).reshape(20, 2), np.arange(20) % 3
    source = stage(prepare_data((X, y)), store.files, "run-1/train.zarr")
    assert source.storage_options == {}
    assert source.url.startswith("s3://") and source.url.endswith("/runs/run-1/train.zarr")
    blob = pickle.dumps(source)
    _assert_clean(blob, key_id, secret)
    clone = pickle.loads(blob)  # reopened through the store, with the credentials registered here
    rows_X, rows_y = clone.slice(5, 20).read(0, 3)
    assert np.array_equal(rows_X, X[5:8]) and np.array_equal(rows_y, y[5:8])


class _PicklingClient:
    """Stands in for a distributed Client in ``stage``: keeps what it would send to the workers, computes here."""

    sent = b""

    def compute(self, collection):
        import cloudpickle

        self.sent = cloudpickle.dumps(collection)
        collection.compute()
        done = Future()
        done.set_result(None)
        return done


def test_staging_dask_data_sends_no_secret_to_workers(secret_store, no_aws_credentials):
    import dask.array as da

    store, key_id, secret = secret_store
    X = da.from_array(np.arange(80, dtype=np.float32).reshape(40, 2), chunks=10)
    y = da.arange(40, chunks=10) % 3
    client = _PicklingClient()
    source = stage(prepare_data((X, y)), store.files, "run-2/train.zarr", client=client)
    assert len(client.sent) > 1000, "the write graph was not handed to the client"
    _assert_clean(client.sent, key_id, secret)
    _assert_clean(pickle.dumps(source), key_id, secret)
    assert np.array_equal(source.read(30, 40)[0], X[30:40].compute())


def test_messages_never_show_a_secret(secret_store, s3):
    store, key_id, secret = secret_store
    with pytest.raises(InvalidLocationError) as info:
        open_store(store.location, endpoint_url=s3.endpoint_url, secret_access_key=secret, bogus=secret)
    _assert_clean(str(info.value), secret)
    err = translate(RuntimeError(f"AccessDenied for {key_id} / {secret}"), f"opening {store.describe()}")
    assert isinstance(err, StoreAccessDeniedError)
    _assert_clean(str(err), key_id, secret)
    assert redact(f"x{secret}x") == "x***x"


def test_worker_plugin_checks_names_and_hides_values():
    plugin = StoreCredentials("s3://bucket/p", key="AKIAEXAMPLE", secret="shh-do-not-show")
    assert plugin.secrets == {"access_key_id": "AKIAEXAMPLE", "secret_access_key": "shh-do-not-show"}
    _assert_clean(repr(plugin), "AKIAEXAMPLE", "shh-do-not-show")
    with pytest.raises(InvalidLocationError, match=r"\['password'\].*'secret_access_key'"):
        StoreCredentials("s3://bucket/p", password="x")
    with pytest.raises(ValueError, match="no credentials to share"):
        share_credentials(None, "s3://nobody-registered-this/p")


@pytest.mark.cluster
@pytest.mark.slow
def test_cluster_without_credentials_is_refused_until_they_are_shared(secret_store, s3, no_aws_credentials):
    from distributed import Client
    from env_helpers import spawned_cluster

    store, key_id, secret = secret_store
    v = store.commit({"w": torch.ones(3)})
    # A second store whose workers read the secret from their own environment, under names we choose.
    by_env = open_store(
        f"s3://{s3.new_bucket()}/params",
        endpoint_url=s3.endpoint_url,
        access_key_id="team-key",
        secret_access_key="team-secret",
    )
    os.environ.update(TEAM_KEY="team-key", TEAM_SECRET="team-secret")  # the scheduler runs in this process
    try:
        with (
            spawned_cluster(env={"TEAM_KEY": "team-key", "TEAM_SECRET": "team-secret"}) as cluster,
            Client(cluster) as client,
        ):
            [worker] = worker_info(client)
            with pytest.raises(StoreCredentialsError) as info:
                check_cluster_access(store, client)
            message = str(info.value)
            assert "1 of 2 processes" in message and worker in message  # the in-process scheduler has them
            assert store.location in message and "share_credentials" in message and "AWS_PROFILE" in message
            _assert_clean(message, key_id, secret)

            share_credentials(client, store)
            check_cluster_access(store, client)
            assert client.submit(lambda s: s.head(), store).result() == v  # a task unpickles it on the worker

            with pytest.raises(StoreCredentialsError, match="1 of 2 processes"):
                check_cluster_access(by_env, client)
            share_credentials(client, by_env, env={"access_key_id": "TEAM_KEY", "secret_access_key": "TEAM_SECRET"})
            check_cluster_access(by_env, client)
    finally:
        os.environ.pop("TEAM_KEY", None)
        os.environ.pop("TEAM_SECRET", None)
        forget_credentials(by_env.location)
