"""A cluster whose scheduler or workers lack vcdask (or PyTorch) is refused before anything is staged or saved,
naming the machines; another PyTorch release there is a warning.  Real `dask` processes whose Python path
shadows vcdask with a package that cannot be imported, as an environment without it would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
from chaos_helpers import worker_info
from distributed import Client, LocalCluster

import vcdask
from vcdask._packages import NoAnswer, ask_workers, check_answers
from vcdask.errors import ClusterPackageError
from vcdask.handle import ensure_plugin

HERE = {"vcdask": vcdask.__version__, "torch": "2.4.1+cpu"}


def _data(n=64):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 4)).astype("float32")
    return X, (X[:, 0] > 0).astype("int64")


@pytest.fixture
def without_vcdask(tmp_path):
    """Environment variables under which a Python process cannot import vcdask."""
    package = tmp_path / "block" / "vcdask"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'vcdask\'", name="vcdask")\n')
    return {"PYTHONPATH": os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")])}


def _dask(command: str, *args: str, env: dict[str, str], cwd) -> subprocess.Popen:
    """A `dask scheduler` or `dask worker` process (``cwd``: not the checkout, whose vcdask it would import)."""
    return subprocess.Popen(
        [sys.executable, "-m", f"distributed.cli.dask_{command}", *args, "--no-dashboard"],
        env={**os.environ, **env},
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _no_runs(store) -> bool:
    from vcdask.cli._listing import run_ids

    return not store.exists() or not run_ids(vcdask.open_store(store, mode="r"))


@pytest.mark.cluster
def test_a_worker_without_vcdask_is_named_before_the_run_is_staged(tmp_path, without_vcdask):
    store = tmp_path / "store"
    local = dict(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp", dashboard_address=None)
    with LocalCluster(**local) as cluster:
        with Client(cluster) as client:
            args = ("--nthreads", "1", "--no-nanny", "--name", "no-vcdask")
            proc = _dask("worker", cluster.scheduler_address, *args, env=without_vcdask, cwd=tmp_path)
            try:
                client.wait_for_workers(2, timeout=60)
                bad = next(a for a, w in worker_info(client).items() if w["name"] == "no-vcdask")
                t0 = time.monotonic()
                with pytest.raises(ClusterPackageError, match="1 of the cluster's machines") as caught:
                    vcdask.fit(torch.nn.Linear(4, 2), _data(), client=client, store=store, progress=False)
                assert time.monotonic() - t0 < 60  # (not no_worker_timeout's 300 s)
                said = str(caught.value)
                assert f"worker {bad} cannot import vcdask (ModuleNotFoundError" in said
                assert "Install vcdask" in said and "nothing was staged or saved" in said
                good = next(a for a in client.scheduler_info()["workers"] if a != bad)
                assert good not in said
                assert isinstance(caught.value, ImportError)
                assert proc.poll() is None  # (the worker was asked, not sent a task it could not unpickle)
                assert _no_runs(store)
            finally:
                proc.kill()
                proc.wait(30)


@pytest.mark.cluster
def test_a_scheduler_without_vcdask_is_named(tmp_path, without_vcdask):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    proc = _dask("scheduler", "--port", str(port), env=without_vcdask, cwd=tmp_path)
    address = f"tcp://127.0.0.1:{port}"
    store = tmp_path / "store"
    try:
        with Client(address, timeout=60) as client:
            with pytest.raises(ClusterPackageError, match=f"scheduler {address} cannot import vcdask"):
                vcdask.fit(torch.nn.Linear(4, 2), _data(), client=client, store=store, progress=False)
            assert _no_runs(store)
            with pytest.raises(ClusterPackageError, match=f"the scheduler at {address} cannot import vcdask"):
                ensure_plugin(client)  # (what starts a run, asked on its own)
    finally:
        proc.kill()
        proc.wait(30)


def test_machines_missing_a_package_are_each_named():
    answers = {
        "scheduler tcp://s:8786": {"vcdask": vcdask.__version__, "torch": "2.4.1+cpu"},
        "worker tcp://a:1": {"vcdask": "missing: ModuleNotFoundError: No module named 'vcdask'", "torch": "2.4.1"},
        "worker tcp://b:1": {"vcdask": vcdask.__version__, "torch": "missing: ImportError: libcudart.so.12"},
        "worker tcp://c:1": RuntimeError("the probe broke"),
        "worker tcp://d:1": NoAnswer("no answer within 10 s"),  # (not known to lack anything: not refused)
    }
    with pytest.raises(ClusterPackageError, match="3 of the cluster's machines") as caught:
        check_answers(answers, HERE)
    said = str(caught.value)
    assert "worker tcp://a:1 cannot import vcdask (ModuleNotFoundError: No module named 'vcdask')" in said
    assert "worker tcp://b:1 cannot import torch (ImportError: libcudart.so.12)" in said
    assert "worker tcp://c:1 (the probe failed: RuntimeError: the probe broke)" in said
    assert "scheduler" not in said.split(". Install")[0] and "tcp://d:1" not in said
    with pytest.warns(RuntimeWarning, match=r"could not ask 1 of the cluster's workers .*tcp://d:1 \(no answer"):
        check_answers({"worker tcp://a:1": HERE, "worker tcp://d:1": answers["worker tcp://d:1"]}, HERE)


@pytest.mark.cluster
def test_a_frozen_worker_is_left_unknown_within_the_probes_time_not_waited_for():
    """One worker of two frozen (SIGSTOP: a paused VM, a machine swapping hard): the check asked both and
    waited for both, for good, and fit never started.  Each worker has its own time to answer."""
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        pids = client.run(os.getpid)
        frozen, running = sorted(pids)
        warm = ask_workers(client, timeout=120.0)  # (the probe's first imports done: the 2 s below is an answer's)
        assert all(answer["vcdask"] == vcdask.__version__ for answer in warm.values())
        os.kill(pids[frozen], signal.SIGSTOP)
        try:
            started = time.monotonic()
            answers = ask_workers(client, timeout=2.0)
            took = time.monotonic() - started
        finally:
            os.kill(pids[frozen], signal.SIGCONT)
    assert isinstance(answers[frozen], NoAnswer) and str(answers[frozen]) == "no answer within 2 s"
    assert answers[running]["vcdask"] == vcdask.__version__ and took < 10


def test_another_torch_minor_is_a_warning_a_build_or_patch_release_is_not():
    same = {"vcdask": vcdask.__version__, "torch": "2.4.0+cu121"}  # (a CUDA build beside a CPU one, a patch behind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_answers({"worker tcp://a:1": same}, HERE)
    older = {"vcdask": vcdask.__version__, "torch": "2.3.1"}
    with pytest.warns(RuntimeWarning, match=r"torch on the cluster differs .* 2\.4\.1\+cpu: worker tcp://b:1: 2\.3\.1"):
        check_answers({"worker tcp://a:1": same, "worker tcp://b:1": older}, HERE)


@pytest.mark.cluster
def test_the_store_check_leaves_a_frozen_worker_unknown_within_its_time(tmp_path, caplog):
    """fit on a caller's cluster checks that every worker can read the store: one frozen worker held that check,
    and fit, for good (the package check had a time a worker; this one had none)."""
    from vcdask.store import _credentials

    store = vcdask.open_store(tmp_path / "s")
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        pids = client.run(os.getpid)
        frozen = sorted(pids)[0]
        _credentials.check_cluster_access(store, client)  # (both answer: the first opening done)
        os.kill(pids[frozen], signal.SIGSTOP)
        try:
            started = time.monotonic()
            with caplog.at_level("WARNING", logger="vcdask.store._credentials"):
                _credentials.check_cluster_access(store, client, timeout=2.0)
            took = time.monotonic() - started
        finally:
            os.kill(pids[frozen], signal.SIGCONT)
    assert took < 10
    assert "could not ask 1 worker(s) whether they can read the store" in caplog.text and frozen in caplog.text
