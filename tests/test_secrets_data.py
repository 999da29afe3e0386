"""Secrets never travel with training data: credentials nested anywhere in a Zarr URL's ``storage_options``, in the
URL itself, or in an Icechunk session's storage are refused before any cluster work, named by where they are and
never by their values; and the remedies the messages give train without writing a secret into the store."""

from __future__ import annotations

import secrets
from pathlib import Path

import icechunk
import msgpack
import numpy as np
import pytest
import torch
import xarray as xr
from refusal_helpers import refused

import vcdask
from vcdask.data import DataError, _zarr_source
from vcdask.store._session_secrets import UNREADABLE, session_credentials

SECRET = f"SECRET-{secrets.token_hex(12)}"
KEY_ID = f"KEYID{secrets.token_hex(6).upper()}"
URL = "s3://bucket/data.zarr"
#: An endpoint nothing listens on: where a refusal were missing, the data would be opened there, never on the internet.
LOOPBACK = {"endpoint_url": "http://127.0.0.1:9"}
#: botocore's names for the credentials (s3fs passes client_kwargs to it).
BOTOCORE = {"aws_access_key_id": KEY_ID, "aws_secret_access_key": SECRET, "aws_session_token": SECRET}


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _dataset(n: int = 60) -> xr.Dataset:
    X = np.random.default_rng(0).normal(size=(n, 3)).astype("float32")
    return xr.Dataset({"X": (("sample", "f"), X), "y": (("sample",), (X[:, 0] > 0).astype("int64"))})


def _files_holding(root: Path, *needles: str, ran: bool = True) -> list[str]:
    """The files under ``root`` whose bytes hold any of ``needles`` (``ran``: a run's spec is there)."""
    assert not ran or any(root.rglob("spec.pkl")), f"no run spec under {root}"
    return [str(p) for p in root.rglob("*") if p.is_file() and any(n.encode() in p.read_bytes() for n in needles)]


# -- storage_options: at any depth --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "options", "paths"),
    [
        (
            URL,
            {"client_kwargs": {**LOOPBACK, **BOTOCORE}},
            [f"client_kwargs.{name}" for name in sorted(BOTOCORE)],
        ),
        (
            f"simplecache::{URL}",
            {"s3": {"key": KEY_ID, "secret": SECRET, "client_kwargs": LOOPBACK}},
            ["s3.key", "s3.secret"],
        ),  # fmt: skip
        (
            URL,
            {
                "client_kwargs": LOOPBACK,
                "s3_additional_kwargs": {"SSECustomerKey": SECRET, "SSECustomerAlgorithm": "AES256"},
            },
            ["s3_additional_kwargs.SSECustomerKey"],
        ),
        (
            "http://127.0.0.1:9/data.zarr",
            {"headers": {"Authorization": f"Bearer {SECRET}", "Accept": "*/*"}},
            ["headers.Authorization"],
        ),  # fmt: skip
        (
            "http://127.0.0.1:9/data.zarr",
            {"headers": {"Cookie": SECRET, "X-Amz-Security-Token": SECRET}},
            ["headers.Cookie", "headers.X-Amz-Security-Token"],
        ),  # fmt: skip
        (URL, {"client_kwargs": {"endpoint_url": f"http://user:{SECRET}@127.0.0.1:9"}}, ["client_kwargs.endpoint_url"]),
    ],
    ids=["botocore-names", "chained-url", "sse-customer-key", "authorization", "cookie-token", "endpoint-userinfo"],
)
def test_nested_secret_storage_options_are_refused_by_their_paths(url, options, paths, tmp_path):
    message = refused(_linear(), url, tmp_path, DataError, f"hold credentials ({paths})", storage_options=options)
    assert SECRET not in message and KEY_ID not in message


def test_non_secret_nested_options_are_kept():
    options = {
        "anon": False,
        "profile": "training",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"},
        "config_kwargs": {"s3": {"addressing_style": "path"}},
        "s3_additional_kwargs": {"ServerSideEncryption": "AES256"},
        "headers": {"Accept": "*/*", "x-amz-server-side-encryption-aws-kms-key-id": "arn:aws:kms:r:1:key/k"},
        "aws_sse_kms_key_id": "arn:aws:kms:r:1:key/k",  # (which key encrypts: an identifier)
    }
    assert _zarr_source(URL, options).storage_options == options
    assert _zarr_source(f"simplecache::{URL}", {"s3": {"anon": True}}).storage_options == {"s3": {"anon": True}}


# -- a URL with credentials in it ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "options", "shown"),
    [
        (f"http://reader:{SECRET}@127.0.0.1:9/data.zarr", None, "'http://***@127.0.0.1:9/data.zarr'"),
        (
            f"simplecache::s3://{KEY_ID}:{SECRET}@bucket/data.zarr",
            {"s3": {"client_kwargs": LOOPBACK}},
            "'simplecache::s3://***@bucket/data.zarr'",
        ),  # fmt: skip
        (
            f"s3://{KEY_ID}:abc/{SECRET}@bucket/data.zarr",
            {"client_kwargs": LOOPBACK},
            "'s3://***@bucket/data.zarr'",
        ),  # (a secret with a "/")  # fmt: skip
    ],
    ids=["http", "chained", "secret-with-slash"],
)
def test_a_data_url_with_credentials_is_refused_masked(url, options, shown, tmp_path):
    message = refused(_linear(), url, tmp_path, DataError, shown, "holds credentials", storage_options=options)
    assert SECRET not in message and KEY_ID not in message


@pytest.mark.parametrize(
    "url",
    [
        "abfs://container@account.dfs.core.windows.net/data.zarr",  # (adlfs's own form: the container, the account)
        "az://container@account.blob.core.windows.net/data.zarr",
        "sftp://alice@127.0.0.1/data.zarr",  # (a user name, no password)
    ],
)
def test_a_name_before_the_host_where_it_names_a_container_or_a_user_is_no_credential(url):
    """These were refused as 'holding credentials', masking the container's name; a password there still is one."""
    assert _zarr_source(url, {"anon": True}).storage_options == {"anon": True}
    with pytest.raises(DataError, match="holds credentials"):
        _zarr_source(url.replace("@", f":{SECRET}@", 1), None)


@pytest.mark.parametrize(
    ("url", "names"),
    [
        (f"https://account.blob.core.windows.net/c/data.zarr?sv=2022-11-02&sp=r&sig={SECRET}", "['sig']"),
        (f"https://127.0.0.1:9/b/data.zarr?X-Amz-Credential={KEY_ID}&X-Amz-Signature={SECRET}", "Signature"),
        (f"simplecache::https://127.0.0.1:9/data.zarr?token={SECRET}", "['token']"),
    ],
    ids=["azure-sas", "s3-presigned", "chained-token"],
)
def test_a_data_url_signed_in_its_query_is_refused_naming_the_parameters_only(url, names, tmp_path):
    """A SAS or presigned URL's signature went into the run's spec with the location (and to every worker)."""
    message = refused(_linear(), url, tmp_path, DataError, "credentials in its query", names)
    assert SECRET not in message and KEY_ID not in message
    assert _zarr_source("https://127.0.0.1:9/data.zarr?version=3&format=zarr", None) is not None  # (a plain query)


# -- Icechunk sessions --------------------------------------------------------------------------------------------
def _fetch_credentials():  # (icechunk pickles it by reference: a function of this module)
    return icechunk.S3StaticCredentials(access_key_id=KEY_ID, secret_access_key=SECRET)


def _s3_repo(s3, bucket: str, **credentials) -> icechunk.Repository:
    def storage(**creds):
        return icechunk.s3_storage(bucket=bucket, prefix="data", endpoint_url=s3.endpoint_url, region="us-east-1",
                                   allow_http=True, force_path_style=True, **creds)  # fmt: skip

    if not icechunk.Repository.exists(storage(from_env=True)):
        repo = icechunk.Repository.create(storage(from_env=True))
        session = repo.writable_session("main")
        _dataset().to_zarr(session.store, consolidated=False, zarr_format=3)
        session.commit("data")
    return icechunk.Repository.open(storage(**credentials))


@pytest.mark.s3
@pytest.mark.parametrize(
    ("credentials", "kind"),
    [
        ({"access_key_id": KEY_ID, "secret_access_key": SECRET, "session_token": SECRET}, "static credentials"),
        (
            {"get_credentials": _fetch_credentials, "scatter_initial_credentials": True},
            "refreshable credentials with initial credentials",
        ),  # fmt: skip
    ],
    ids=["static", "refreshable-with-initial"],
)
def test_an_icechunk_session_holding_credentials_is_refused(s3, credentials, kind, tmp_path):
    session = _s3_repo(s3, s3.new_bucket(), **credentials).readonly_session("main")
    assert SECRET.encode() in session.store.__getstate__()["_store"]  # (what Icechunk's pickle would carry)
    for data in (session, session.store):
        message = refused(_linear(), data, tmp_path, DataError, kind, "from_env=True", "chunks=None", "URL")
        assert SECRET not in message and KEY_ID not in message


@pytest.mark.s3
def test_an_icechunk_session_whose_workers_find_credentials_is_taken(s3, tmp_path):
    from vcdask.options import plan

    repo = _s3_repo(s3, s3.new_bucket(), from_env=True)
    assert plan(_linear(), repo.readonly_session("main"), store=tmp_path / "s").train.n == 60
    refreshing = _s3_repo(s3, s3.new_bucket(), get_credentials=_fetch_credentials)  # (no initial ones: fetched there)
    assert session_credentials(refreshing.readonly_session("main")) == []


def test_static_credentials_for_virtual_chunks_are_found(tmp_path):
    """Credentials a repository is opened with for its virtual chunks are in its sessions' pickles too."""
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "repo")))
    assert session_credentials(repo.readonly_session("main")) == []
    config = icechunk.RepositoryConfig.default()
    container = icechunk.VirtualChunkContainer("s3://vbucket/", icechunk.s3_store(region="us-east-1"))
    config.set_virtual_chunk_container(container)
    static = icechunk.s3_static_credentials(access_key_id=KEY_ID, secret_access_key=SECRET)
    repo = icechunk.Repository.open(
        icechunk.local_filesystem_storage(str(tmp_path / "repo")),
        config=config,
        authorize_virtual_chunk_access=icechunk.containers_credentials({"s3://vbucket/": static}),
    )
    assert session_credentials(repo.readonly_session("main")) == ["static credentials"]
    message = refused(_linear(), repo.readonly_session("main"), tmp_path / "run", DataError, "static credentials")
    assert SECRET not in message and KEY_ID not in message


class _Pickled:
    """A stand-in for an Icechunk store whose pickled state is ``tree`` (msgpack) or ``blob``."""

    def __init__(self, tree=None, blob=None):
        self.blob = msgpack.packb(tree) if blob is None else blob

    def __getstate__(self):
        return {"_store": self.blob, "_read_only": True}


@pytest.mark.parametrize(
    ("tree", "found"),
    [
        ({"credentials": ["from_env"], "config": {"account": "a"}}, []),
        ({"credentials": ["anonymous"]}, []),
        (
            {"credentials": ["static", {"gcs_static_credential_type": "service_account_key", "__field0": SECRET}]},
            ["static credentials"],
        ),  # fmt: skip
        ({"credentials": ["static", ["access_key", SECRET]]}, ["static credentials"]),
        ({"credentials": ["a_kind_not_known_yet", SECRET]}, ["a_kind_not_known_yet credentials"]),
        ({"credentials": {"gcs_credential_type": "refreshable", "initial": None}}, []),
        ({"credentials": {"s3_credential_type": "refreshable"}}, ["refreshable credentials with initial credentials"]),
        ({"config": {"google_service_account_key": SECRET}}, ["the secret entry 'google_service_account_key'"]),
        ({"extra_read_headers": [["Authorization", SECRET]]}, ["the header 'Authorization'"]),
    ],
)
def test_what_an_icechunk_state_holds(tree, found):
    assert session_credentials(_Pickled(tree)) == found


def test_an_icechunk_state_that_cannot_be_read_is_not_trusted():
    assert session_credentials(_Pickled(blob=b"\xc1 not msgpack")) == [UNREADABLE]
    assert session_credentials(object()) == [UNREADABLE]


# -- the remedies write no secret --------------------------------------------------------------------------------
@pytest.mark.s3
def test_a_session_holding_credentials_copied_as_the_message_says_writes_no_secret(s3, threaded_client, tmp_path):
    """The message's copy: read here (chunks=None), staged into the run's store; no file of the store holds them."""
    session = _s3_repo(s3, s3.new_bucket(), access_key_id=KEY_ID, secret_access_key=SECRET).readonly_session("main")
    data = xr.open_zarr(session.store, consolidated=False, chunks=None)
    store = tmp_path / "store"
    result = vcdask.fit(_linear(), data, store=store, client=threaded_client, max_epochs=1, progress=False)
    assert len(result.epochs) == 1
    assert _files_holding(store, SECRET, KEY_ID) == []


@pytest.mark.s3
def test_a_zarr_url_with_nested_public_options_trains_and_writes_no_secret(s3, threaded_client, tmp_path, monkeypatch):
    """The workers' own credentials (the environment here) read it; the options in the spec hold none."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)  # (moto takes any)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    bucket = s3.new_bucket()
    options = {"client_kwargs": {"endpoint_url": s3.endpoint_url, "region_name": "us-east-1"}}
    _dataset().to_zarr(f"s3://{bucket}/data.zarr", storage_options=options, consolidated=False, zarr_format=3)
    store = tmp_path / "store"
    result = vcdask.fit(_linear(), f"s3://{bucket}/data.zarr", storage_options=options, store=store,
                        client=threaded_client, max_epochs=1, progress=False)  # fmt: skip
    assert len(result.epochs) == 1
    assert _files_holding(store, SECRET, KEY_ID) == []


@pytest.mark.s3
@pytest.mark.parametrize("given", ["nested-options", "icechunk-session"])
def test_a_fit_given_secrets_with_its_data_writes_none_into_the_store(given, s3, threaded_client, tmp_path):
    """Where they were taken (before the refusals), a real run wrote them into its spec: none of the store's files
    may hold them."""
    bucket = s3.new_bucket()
    endpoint = {"endpoint_url": s3.endpoint_url, "region_name": "us-east-1"}
    if given == "nested-options":
        _dataset().to_zarr(f"s3://{bucket}/data.zarr", storage_options={"client_kwargs": endpoint}, consolidated=False)
        data = f"s3://{bucket}/data.zarr"
        kwargs = {"storage_options": {"client_kwargs": {**endpoint, "aws_access_key_id": KEY_ID,
                                                        "aws_secret_access_key": SECRET}}}  # fmt: skip
    else:
        data = _s3_repo(s3, bucket, access_key_id=KEY_ID, secret_access_key=SECRET).readonly_session("main")
        kwargs = {}
    store = tmp_path / "store"
    try:
        vcdask.fit(_linear(), data, store=store, client=threaded_client, max_epochs=1, progress=False, **kwargs)
    except DataError as e:
        refusal = str(e)
    else:
        refusal = None
    assert _files_holding(store, SECRET, KEY_ID, ran=False) == []
    assert refusal is not None and SECRET not in refusal and KEY_ID not in refusal
