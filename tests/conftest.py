from __future__ import annotations

import os
import time

import dask.config
import pytest

from vcdask.testing.s3 import moto_server

# Worker processes are forked from a server that has PyTorch imported (vcdask.cluster.start_forkserver):
# the suite starts dozens of clusters and restarts workers often, and a spawned worker pays 5-7 s of CPU for
# its imports each time.  Subprocesses (notebook kernels, example scripts, `vcdask` jobs) inherit the setting
# through the environment.  Dask's default, spawn, is what the demo test (the README's first command) and the
# cold-start test run; `VCDASK_TEST_START_METHOD=spawn` runs the whole suite on it.
START_METHOD_VAR = "DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD"
os.environ[START_METHOD_VAR] = os.environ.get("VCDASK_TEST_START_METHOD", "forkserver")
dask.config.set({"distributed.worker.multiprocessing-method": os.environ[START_METHOD_VAR]})
# Dask's sampling profiler (a thread in every worker that reads the stacks every 10 ms) is a dashboard diagnostic no
# test reads: off, an idle worker uses half the CPU (0.45 s a minute of 20 s against 1.0 s) and training ran about
# 3% faster (digits, 2 workers, medians of 3), across the suite's hundred-odd clusters.  Subprocesses inherit it too.
PROFILER_VAR = "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"
os.environ[PROFILER_VAR] = "False"
dask.config.set({"distributed.worker.profile.enabled": False})

# Tests that start real Dask worker processes carry the ``cluster`` marker (``make test-fast`` leaves them out).
# A test is marked here when it uses the ``cluster`` fixture, directly or through ``client`` or any fixture built
# on them; a test that starts its own cluster (``embedded_cluster``, ``LocalCluster``, ``vcdask.fit`` without a
# client) says so with ``@pytest.mark.cluster``. Under ``-m "not cluster"`` such a test that forgot the marker
# fails and says so (``_unmarked_worker_processes`` below), so the fast subset stays fast as tests are added.
WORKER_PROCESS_FIXTURES = frozenset({"cluster"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects
def pytest_collection_modifyitems(items):
    import torch

    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if WORKER_PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_cuda)


@pytest.fixture(autouse=True)
def _unmarked_worker_processes(request, monkeypatch):
    """Under ``-m "not cluster"``: fail a test that starts a LocalCluster with worker processes unmarked."""
    if "not cluster" not in request.config.getoption("markexpr") or request.node.get_closest_marker("cluster"):
        return
    from distributed import LocalCluster, Nanny

    start = LocalCluster.__init__

    def guarded(self, *args, **kwargs):
        processes = kwargs.get("processes")
        if processes is None:  # LocalCluster's default
            processes = issubclass(kwargs.get("worker_class") or Nanny, Nanny)
        if processes:
            pytest.fail(
                f"{request.node.nodeid} starts a LocalCluster with worker processes: mark it "
                "@pytest.mark.cluster (or use the `client` fixture), or pass processes=False",
                pytrace=False,
            )
        start(self, *args, **kwargs)

    monkeypatch.setattr(LocalCluster, "__init__", guarded)


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server process on 127.0.0.1 (free port) for the whole session."""
    with moto_server() as server:
        yield server


@pytest.fixture
def no_aws_credentials(monkeypatch):
    """This process (and the processes it starts from now on) has no AWS credentials of its own: none in its
    environment, and none in the rest of the standard chain (profile files, the instance metadata service).
    Listed after ``s3``, it takes that fixture's credentials away."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                        "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():  # fmt: skip
        monkeypatch.setenv(name, value)


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


def _busy(client) -> dict:
    """Tasks still running on the shared cluster's workers, by worker: cancelled ones included (a
    finished test's run may have left some, e.g. stuck reading a store it broke)."""

    def running(dask_worker) -> int:
        return len(dask_worker.state.executing) + len(dask_worker.state.long_running)

    return {w: n for w, n in client.run(running).items() if n}


@pytest.fixture
def threaded_client():
    """A client of a cluster of one worker thread in this process: a real fit without worker processes."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as c,
    ):
        yield c


@pytest.fixture
def client(cluster):
    """The shared cluster's client, its workers idle: a test that counts on both workers must not find
    one still busy with an earlier test's task (restarted after a short wait)."""
    client = cluster[1]
    deadline = time.monotonic() + 5.0
    while _busy(client) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _busy(client):
        client.restart()
    return client


@pytest.fixture(scope="session")
def digits_data():
    from vcdask.demo import digits

    return digits()
