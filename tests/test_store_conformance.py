"""Every backend passes the same conformance suite (vcdask.testing.store.StoreTests)."""

from __future__ import annotations

import pickle
import pickletools
import shutil
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
    with pytest.raises(StoreNotFoundError, match="no vcdask store"):
        pickle.loads(blob)
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
        pickle.loads(pickle.dumps(_EarlierPickle(str(tmp_path / "gone"), mode)))
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

