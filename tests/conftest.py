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


@pytest.fixture(scope="session")
def cluster():
    """A real LocalCluster: 2 worker processes, 1 thread each, shared by the engine tests."""
    from distributed import Client

    from vcdask.cluster import embedded_cluster

    with embedded_cluster(n_workers=2) as cl, Client(cl, set_as_default=False) as c:
        yield cl, c


@pytest.fixture
def client(cluster):
    return cluster[1]


@pytest.fixture(scope="session")
def digits_data():
    from vcdask.demo import digits

    return digits()
