"""Every backend passes the same conformance suite (vcdask.testing.store.StoreTests)."""

from __future__ import annotations

import json
import pickle
import pickletools
import shutil
import time
import uuid

import cloudpickle
import pytest
import torch

from vcdask import open_store
from vcdask.errors import StoreNotFoundError
from vcdask.store import BACKENDS, StoreBackend
from vcdask.store._memory import MemoryBackend
from vcdask.testing.store import StoreTests


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        return open_store(tmp_path / "store")


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self):
        name = f"memory://{uuid.uuid4().hex}"
        yield open_store(name)
        MemoryBackend.forget(name)


@pytest.mark.s3
class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, s3):
        bucket = s3.new_bucket()
        return open_store(f"s3://{bucket}/params", **s3.options())

    @pytest.fixture
    def store_options(self, s3):
        return s3.options()


_S3_SECRETS = {"access_key_id", "secret_access_key", "session_token"}
_GCS_SECRETS = {"service_account_key", "bearer_token"}
_AZURE_SECRETS = {"access_key", "sas_token", "bearer_token"}
SECRET_OPTIONS = {
    "file": set(),
    "memory": set(),
    "s3": _S3_SECRETS,
    "gs": _GCS_SECRETS,
    "gcs": _GCS_SECRETS,
    "az": _AZURE_SECRETS,
    "abfs": _AZURE_SECRETS,
}


@pytest.mark.parametrize("scheme", sorted(BACKENDS))
def test_every_backend_follows_the_protocol(scheme, tmp_path):
    location = {"file": str(tmp_path / "s"), "memory": "memory://protocol"}.get(scheme, f"{scheme}://bucket/prefix")
    backend = BACKENDS[scheme](location, {"account": "acct"} if scheme in ("az", "abfs") else {})
    assert isinstance(backend, StoreBackend)
    assert backend.secret_options == SECRET_OPTIONS[scheme]  # what a pickled store leaves out
    assert backend.secret_options <= getattr(backend, "valid_options", set())  # each a real option


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps])
def test_a_pickled_store_names_what_reopens_it_by_the_paths_it_always_had(dumps, tmp_path):
    """Run specs written to a store hold pickled stores: whichever module defines ``open_store``, a store
    pickles as a call of ``vcdask.store._icechunk._reopen`` with ``vcdask.store.open_store``, so that specs
    written by earlier vcdask versions load in this one, and the other way round."""
    store = open_store(tmp_path / "store")
    data = dumps(store)
    names = [arg for op, arg, _ in pickletools.genops(data) if op.name == "SHORT_BINUNICODE"]
    assert names[:4] == ["vcdask.store._icechunk", "_reopen", "vcdask.store", "open_store"]
    assert pickle.loads(data).location == store.location


# -- what a pickled copy reopens: the store its original opened, never a new one -----------------------------------
def test_a_copy_of_a_store_created_with_w_minus_reopens_it(tmp_path):
    store = open_store(tmp_path / "store", mode="w-")
    v = store.commit({"w": torch.ones(2)})
    copy = pickle.loads(pickle.dumps(store))  # a worker, load_spec, resume: all unpickle it
    assert copy.mode == "r+" and copy.head() == v
    assert copy.commit({"w": torch.zeros(2)}, parent=v) == store.head()


def test_a_copy_where_the_store_is_missing_says_so_and_creates_nothing(tmp_path):
    """A worker without the shared filesystem: the copy of a mode="a" store must not make an empty store there."""
    store = open_store(tmp_path / "store")  # mode="a"
    store.commit({"w": torch.ones(2)})
    blob = pickle.dumps(store)
    shutil.rmtree(tmp_path / "store")
    copy = pickle.loads(blob)  # (unpickling opens nothing: its first use does)
    with pytest.raises(StoreNotFoundError, match="no vcdask store"):
        copy.head()
    assert not (tmp_path / "store").exists()


def test_a_copy_of_a_read_only_store_stays_read_only(tmp_path):
    open_store(tmp_path / "store").commit({"w": torch.ones(2)})
    copy = pickle.loads(pickle.dumps(open_store(tmp_path / "store", mode="r")))
    assert copy.mode == "r" and not copy.writable


class _EarlierPickle:
    """A store as earlier vcdask versions pickled it: a call of ``_reopen`` carrying the original's mode."""

    def __init__(self, location, mode):
        self.location, self.mode = location, mode

    def __reduce__(self):
        from vcdask.store._icechunk import _reopen

        kwargs = {"mode": self.mode, "chunk_bytes": None, "commit_retries": None, "max_tries": None}
        return (_reopen, (open_store, self.location, kwargs))


@pytest.mark.parametrize("mode", ["a", "w-", "r+"])
def test_an_earlier_pickle_reopens_the_existing_store_for_writing(mode, tmp_path):
    v = open_store(tmp_path / "store").commit({"w": torch.ones(2)})
    copy = pickle.loads(pickle.dumps(_EarlierPickle(str(tmp_path / "store"), mode)))
    assert copy.mode == "r+" and copy.head() == v
    with pytest.raises(StoreNotFoundError):  # nothing there: no new empty store
        pickle.loads(pickle.dumps(_EarlierPickle(str(tmp_path / "gone"), mode))).head()
    assert not (tmp_path / "gone").exists()


def test_a_copy_of_a_memory_store_is_the_same_store():
    name = f"memory://{uuid.uuid4().hex}"
    try:
        store = open_store(name)
        copy = pickle.loads(pickle.dumps(store))
        v = copy.commit({"w": torch.ones(2)})
        assert store.head() == v and copy.mode == "r+"
    finally:
        MemoryBackend.forget(name)


# -- secrets inside ``config`` (GCS, Azure): kept in this process as secret options, never in a copy -----------------
SERVICE_ACCOUNT_JSON = '{"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY-----\\nGCSSECRET"}'


@pytest.mark.parametrize(
    ("location", "options", "secret_config", "public_config"),
    [
        (
            "gs://bucket/runs",
            {},
            {"google_service_account_key": SERVICE_ACCOUNT_JSON, "service_account_key": "GCSSECRET2"},
            {"google_service_account": "/keys/sa.json", "google_application_credentials": "/keys/adc.json"},
        ),
        (
            "az://models/runs",
            {"account": "acct"},
            {
                "azure_storage_account_key": "AZKEY==",
                "azure_storage_sas_key": "sv=2024&sig=AZSAS",
                "azure_storage_token": "AZBEARER",
                "azure_client_secret": "AZCLIENTSECRET",
                "azure_fabric_session_token": "AZFABRIC",
            },
            {"azure_client_id": "cid", "azure_storage_tenant_id": "tid", "azure_federated_token_file": "/t"},
        ),
    ],
)
def test_secrets_in_config_stay_in_this_process_and_a_copy_gets_them_back(
    location, options, secret_config, public_config
):
    from vcdask.store._copies import split_options
    from vcdask.store._credentials import forget_credentials, lookup_credentials, redact, register_credentials
    from vcdask.store._schemes import backend_for

    backend = backend_for(location, "a", {**options, "config": {**secret_config, **public_config}})
    public, secrets = split_options(backend)
    assert public == {**options, "config": public_config}  # what a pickled store carries
    assert secrets == {f"config.{k}": v for k, v in secret_config.items()}  # store.holds_secrets
    blob = pickle.dumps(public)
    assert not any(v.encode() in blob for v in secret_config.values())
    register_credentials(location, **secrets)  # as the store does when it opens
    try:
        assert redact(f"refused: {' '.join(secret_config.values())}") == "refused: " + " ".join(
            ["***"] * len(secret_config)
        )
        copy = backend_for(location, "r+", {**public, **lookup_credentials(location)})  # as a copy reopens
        assert copy.options == backend.options and copy.secret_options == backend.secret_options
        copy.storage()  # Icechunk takes the joined config
    finally:
        forget_credentials(location)
    alone = backend_for(location, "r+", public)  # unpickled where none are registered: the provider's chain
    assert not (alone.secret_options - BACKENDS[alone.scheme].secret_options)


def test_which_config_keys_are_secret():
    from vcdask.store._object import is_secret_config_key

    secret = ["google_service_account_key", "azure_storage_account_key", "azure_storage_access_key", "master_key",
              "azure_storage_sas_token", "sas_key", "azure_storage_token", "bearer_token", "azure_client_secret",
              "Password", "azure_fabric_session_token"]  # fmt: skip
    public = ["google_service_account", "google_application_credentials", "azure_federated_token_file",
              "azure_client_id", "azure_storage_tenant_id", "azure_storage_account_name", "azure_use_azure_cli",
              "azure_msi_endpoint", "azure_skip_signature"]  # fmt: skip
    assert [k for k in secret if not is_secret_config_key(k)] == []
    assert [k for k in public if is_secret_config_key(k)] == []


def test_secret_config_entries_are_named_as_secret_options():
    from vcdask.errors import InvalidLocationError
    from vcdask.store._credentials import StoreCredentials

    plugin = StoreCredentials("az://c/p", env={"config.azure_client_secret": "TEAM_AZ_SECRET"})
    assert repr(plugin) == "<StoreCredentials 'az://c/p' config.azure_client_secret>"
    with pytest.raises(InvalidLocationError, match=r"\['config.azure_client_id'\] are not secret options"):
        StoreCredentials("az://c/p", **{"config.azure_client_id": "cid"})
    with pytest.raises(InvalidLocationError, match=r"unknown storage option\(s\) \['config.google_bucket'\]"):
        open_store("gs://b/p", **{"config.google_bucket": "b"})
    with pytest.raises(InvalidLocationError, match="config for 'gs://b/p' must be a mapping"):
        open_store("gs://b/p", config="google_service_account_key=x")


# -- side files on GCS and Azure take the store's explicit credentials (the arguments of gcsfs / adlfs) -----------
@pytest.mark.parametrize(
    ("options", "token"),
    [
        ({"service_account_key": SERVICE_ACCOUNT_JSON}, json.loads(SERVICE_ACCOUNT_JSON)),
        ({"service_account_file": "/keys/sa.json"}, "/keys/sa.json"),
        ({"application_credentials": "/keys/adc.json"}, "/keys/adc.json"),
        ({"anonymous": True}, "anon"),
        ({}, None),  # gcsfs's own chain
    ],
)
def test_gcs_side_files_get_the_stores_credentials(options, token):
    from vcdask.store._object import GCSBackend

    assert GCSBackend("gs://bucket/runs", options).filesystem_kwargs() == {"token": token}


def test_gcs_side_files_get_the_stores_bearer_token():
    pytest.importorskip("google.oauth2.credentials")  # installed with gcsfs
    from vcdask.store._object import GCSBackend

    token = GCSBackend("gs://bucket/runs", {"bearer_token": "ya29.TOKEN"}).filesystem_kwargs()["token"]
    assert token.token == "ya29.TOKEN" and token.valid


def test_azure_side_files_get_the_stores_credentials():
    import asyncio

    from vcdask.store._object import AzureBackend

    def kwargs(**options):
        return AzureBackend("az://models/runs", {"account": "acct", **options}).filesystem_kwargs()

    assert kwargs() == {"account_name": "acct"}  # adlfs's own chain
    assert kwargs(access_key="AZKEY==") == {"account_name": "acct", "account_key": "AZKEY=="}
    assert kwargs(sas_token="sv=1&sig=S") == {"account_name": "acct", "sas_token": "sv=1&sig=S"}
    credential = kwargs(bearer_token="AZBEARER")["credential"]
    assert "AZBEARER" not in repr(credential)
    got = asyncio.run(credential.get_token("https://storage.azure.com/.default"))
    assert got.token == "AZBEARER" and got.expires_on > time.time() + 300  # the SDK's policy does not refresh it


def test_a_process_keeps_the_stores_it_unpickled_used_last(tmp_path):
    """Copies of one store unpickle as one store in a process (a worker's tasks reuse its opened repository);
    a long-lived worker serving runs in many stores kept every one it ever opened.  It keeps the newest, and a
    store it dropped still works for whoever holds it."""
    from vcdask.store import _copies

    n = _copies.MAX_REOPENED + 2
    pickles = [pickle.dumps(open_store(tmp_path / f"s{i}")) for i in range(n)]
    first = pickle.loads(pickles[0])
    assert pickle.loads(pickles[0]) is first  # (one store per location: reused)
    for data in pickles[1:]:
        pickle.loads(data)
    kept = [str(tmp_path / f"s{i}") for i in range(2, n)]
    assert [key[0] for key in _copies._reopened] == kept  # (the newest; earlier tests' stores went too)
    assert pickle.loads(pickles[0]) is not first and list(first.branches()) == ["main"]  # (dropped, still open)
    assert pickle.loads(pickles[3]) is pickle.loads(pickles[3]) and len(_copies._reopened) == _copies.MAX_REOPENED
