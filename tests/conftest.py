from __future__ import annotations

import pytest

from vcdask.testing.s3 import moto_server


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server process on 127.0.0.1 (free port) for the whole session."""
    with moto_server() as server:
        yield server


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The S3 server, emptied after the test, with dummy credentials in the environment."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    yield s3_server
    s3_server.reset()
