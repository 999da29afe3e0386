"""Every backend passes the same conformance suite (vcdask.testing.store.StoreTests)."""

from __future__ import annotations

import pickle
import pickletools
import uuid

import cloudpickle
import pytest

from vcdask import open_store
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
