"""Every backend passes the same conformance suite (vcdask.testing.store.StoreTests)."""

from __future__ import annotations

import uuid

import pytest

from vcdask import open_store
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
