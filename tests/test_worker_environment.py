"""Workers (and a scheduler) whose environment cannot run a run: real `dask worker` processes started beside a
healthy one with another ``PYTHONPATH`` (no module of the user's model), or in a mount namespace of their own
(``unshare``) where the store's directory is another one, hidden, or read-only.  Each such worker is named, gets
no more shards, and the run goes on with the healthy one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

import vcdask
from vcdask import Resilience
from vcdask.cli._listing import run_ids

pytestmark = pytest.mark.cluster

MODEL = """
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x)
"""


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


needs_unshare = pytest.mark.skipif(not _can_unshare(), reason="needs `unshare -rm` (mount namespaces) on this machine")


@pytest.fixture
def model_module(tmp_path, monkeypatch):
    """A module of the user's own (``mymodels_<hex>``) in a folder of its own, importable here (the client and
    the in-process scheduler) but not on a worker without that folder on its ``PYTHONPATH``: (name, folder)."""
    name = f"mymodels_{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "modules"
    folder.mkdir()
    (folder / f"{name}.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(folder))
    return name, folder


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def _worker(scheduler: str, name: str, env: dict[str, str], mounts: str = "") -> subprocess.Popen:
    """A `dask worker` process (1 thread), with ``env``; ``mounts``: shell commands run first in a mount
    namespace of its own (its view of the filesystem, no other process's)."""
    cmd = [sys.executable, "-m", "distributed.cli.dask_worker", scheduler, "--nthreads", "1", "--no-nanny"]
    cmd += ["--name", name, "--no-dashboard"]
    if mounts:
        cmd = ["unshare", "-rm", "sh", "-c", f'{mounts} && exec "$@"', "sh", *cmd]
    return subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _address(client, name: str, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for address, info in client.scheduler_info()["workers"].items():
            if info.get("name") == name:
                return address
        time.sleep(0.2)
    raise TimeoutError(f"worker {name} never joined")


@pytest.fixture
def scheduler():
    """A scheduler (in this process) with no workers of its own, its client, and the worker processes a test
    starts (stopped at the end)."""
    from distributed import Client, LocalCluster

    procs: list[subprocess.Popen] = []
    with (
        LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        yield client, procs
        for p in procs:
            p.kill()
            p.wait(30)


def _fit(client, model, store, **kwargs):
    x, y = _data()
    options = {"max_epochs": 2, "n_shards": 4, "batch_size": 32, "lr": 0.05, "progress": False}
    return vcdask.fit(model, (x, y), client=client, store=str(store), **{**options, **kwargs})


def _excluded(result, address: str) -> str:
    return str(result.workers.set_index("worker").loc[address, "excluded"])


def test_a_worker_without_the_models_module_gets_no_shards_and_the_run_goes_on(scheduler, model_module, tmp_path):
    """A worker lacking the module of the user's model class made the run fail at once (``ModuleNotFoundError``,
    naming neither the worker nor the fix); it is now unfit for the run, named with the remedies."""
    client, procs = scheduler
    name, folder = model_module
    procs.append(_worker(client.scheduler.address, "good", {"PYTHONPATH": str(folder)}))
    procs.append(_worker(client.scheduler.address, "bare", {}))
    bare = _address(client, "bare")
    _address(client, "good")
    model = __import__(name).Net()
    result = _fit(client, model, tmp_path / "store", max_epochs=3)
    reason = _excluded(result, bare)
    assert f"worker {bare} cannot load run" in reason and f"No module named '{name}'" in reason, reason
    assert "client.upload_file" in reason and "__main__" in reason
    assert (
        result.history["worker"].ne(bare).all() or (result.history.query("worker == @bare")["outcome"] == "lost").all()
    )
    assert len(result.epochs) == 3


@needs_unshare
def test_a_worker_that_sees_another_store_at_the_same_path_gets_no_shards(scheduler, tmp_path):
    """A worker whose directory at the store's path is a stale copy (another machine's) failed every attempt of
    a shard in under a second (``FileNotFoundError: no object '.../spec.pkl'``), the healthy worker idle; it is
    now unfit for the run, named, and its copies go to the other worker without counting as attempts."""
    client, procs = scheduler
    store = tmp_path / "store"
    vcdask.open_store(str(store), mode="a")
    stale = tmp_path / "stale"
    shutil.copytree(store, stale)  # (the store as it was before the run: no run in it)
    procs.append(_worker(client.scheduler.address, "good", {}))
    procs.append(_worker(client.scheduler.address, "other", {}, mounts=f"mount --bind {stale} {store}"))
    other = _address(client, "other")
    _address(client, "good")
    result = _fit(client, __import__("torch").nn.Linear(4, 2), store, resilience=Resilience(max_attempts=1))
    reason = _excluded(result, other)
    assert f"worker {other} does not see the store at" in reason, reason
    assert "a local store must be on a filesystem every worker shares; use an object store" in reason


@needs_unshare
def test_a_worker_joining_without_the_store_gets_no_shards(scheduler, tmp_path):
    """A worker that joins mid-run with the store's directory hidden (an empty one at its path) ended the run with
    ``StoreNotFoundError ... use mode='a' to create one``; it is now unfit, named, and the run goes on."""
    client, procs = scheduler
    store = tmp_path / "store"
    empty = tmp_path / "empty"
    empty.mkdir()
    procs.append(_worker(client.scheduler.address, "good", {}))
    _address(client, "good")
    handle = _fit(client, __import__("torch").nn.Linear(4, 2), store, max_epochs=30, wait=False)
    procs.append(_worker(client.scheduler.address, "hidden", {}, mounts=f"mount --bind {empty} {store}"))
    hidden = _address(client, "hidden")
    result = handle.result()
    reason = _excluded(result, hidden)
    assert f"worker {hidden} does not see the store at" in reason and "no vcdask store at" in reason, reason
    assert "mode='a'" not in reason


@needs_unshare
def test_a_worker_on_a_read_only_mount_is_excluded_not_an_outage(scheduler, tmp_path):
    """Every update a worker wrote to a read-only mount failed with ``EROFS``, which the run took for a store
    outage (paused each time, the worker never excluded; alone, it failed after ``store_outage_timeout`` blaming
    the store).  It is now refused by the store (access denied): the worker is blamed and excluded."""
    client, procs = scheduler
    store = tmp_path / "store"
    vcdask.open_store(str(store), mode="a")
    procs.append(_worker(client.scheduler.address, "good", {}))
    procs.append(_worker(client.scheduler.address, "readonly", {}, mounts=f"mount --bind -o ro {store} {store}"))
    readonly = _address(client, "readonly")
    _address(client, "good")
    resilience = Resilience(max_worker_failures=1, store_outage_timeout=30)
    result = _fit(client, __import__("torch").nn.Linear(4, 2), store, resilience=resilience)
    assert _excluded(result, readonly).startswith("1 failed"), _excluded(result, readonly)
    there = result.history[result.history["worker"] == readonly]
    assert len(there) and there["reason"].str.contains("StoreAccessDeniedError.*Read-only file system").all()
    assert not result.history["outcome"].eq("store fault").any()


def test_a_scheduler_without_the_models_module_says_so_and_leaves_no_run(model_module, tmp_path):
    """A scheduler that cannot import the module of the model's class raised a bare ``ModuleNotFoundError`` and
    left the run's branch and folder behind (``incomplete 0/2`` in ``vcdask runs``)."""
    from distributed import Client

    from vcdask.errors import SchedulerEnvironmentError

    name, folder = model_module
    port = 20000 + os.getpid() % 20000
    address = f"tcp://127.0.0.1:{port}"
    sched = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port)]
        + ["--dashboard-address", ":0"],
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker = _worker(address, "good", {"PYTHONPATH": str(folder)})
    try:
        with Client(address, timeout=60, set_as_default=False) as client:
            client.wait_for_workers(1, timeout=90)
            store = tmp_path / "store"
            with pytest.raises(SchedulerEnvironmentError) as raised:
                _fit(client, __import__(name).Net(), store)
            message = str(raised.value)
            assert f"the scheduler {address} cannot" in message and f"No module named '{name}'" in message, message
            assert "client.upload_file" in message and "__main__" in message
            assert isinstance(raised.value, ImportError)
            opened = vcdask.open_store(str(store), mode="r")
            assert run_ids(opened) == [] and [b for b in opened.branches() if b != "main"] == []
    finally:
        for p in (worker, sched):
            p.kill()
            p.wait(30)


def test_a_version_mismatch_warning_points_at_the_users_call(scheduler, tmp_path):
    """The launch's warning that a worker's vcdask differs pointed at vcdask/launching.py, not at ``fit``."""
    client, procs = scheduler
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text("import vcdask\nvcdask.__version__ = '0.0.1'\n")
    procs.append(_worker(client.scheduler.address, "older", {"PYTHONPATH": str(folder)}))
    _address(client, "older")
    with pytest.warns(RuntimeWarning, match="vcdask on the cluster differs") as caught:
        _fit(client, __import__("torch").nn.Linear(4, 2), tmp_path / "store", max_epochs=1)
    [warning] = [w for w in caught if "vcdask on the cluster differs" in str(w.message)]
    assert warning.filename == __file__, warning.filename


def test_a_worker_joining_with_another_vcdask_is_named_in_the_schedulers_log(scheduler, tmp_path, caplog):
    """The launch checks the workers there then; one that joined later with another vcdask trained shards without
    a word (and where its tasks and the plugin no longer spoke alike, lost them).  It is asked at once and named
    with what to install; it is not excluded, as the launch does not exclude such workers once it has warned."""
    import logging

    client, procs = scheduler
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text("import vcdask\nvcdask.__version__ = '0.0.1'\n")
    procs.append(_worker(client.scheduler.address, "good", {}))
    _address(client, "good")
    caplog.set_level(logging.WARNING, logger="vcdask.engine.identify")  # (the scheduler is this process)
    handle = _fit(client, __import__("torch").nn.Linear(4, 2), tmp_path / "store", max_epochs=10_000, wait=False)
    procs.append(_worker(client.scheduler.address, "older", {"PYTHONPATH": str(folder)}))
    older = _address(client, "older")
    said = f"worker {older} joined with vcdask 0.0.1, the scheduler has {vcdask.__version__}"
    deadline = time.monotonic() + 60
    while said not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.2)
    handle.stop()
    result = handle.result()
    assert f"install vcdask {vcdask.__version__} on it" in caplog.text
    assert caplog.text.count(said) == 1 and str(result.workers.set_index("worker").loc[older, "excluded"]) == "None"


class _Module:
    """Unpickles as ``importlib.import_module(name)``."""

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        import importlib

        return importlib.import_module, (self.name,)


class _Lookup:
    """Unpickles as ``getattr(module, attribute)``: the look-up a spec's unpickling makes of a class's name."""

    def __init__(self, module: str, attribute: str):
        self.module, self.attribute = module, attribute

    def __reduce__(self):
        return getattr, (_Module(self.module), self.attribute)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (_Lookup("json", "gelu_new"), "module 'json'"),  # (not 'gelu_new', the attribute: e.name)
        (_Module("helpers_not_here"), "module 'helpers_not_here'"),
    ],
    ids=["attribute of a module", "module not found"],
)
def test_the_module_to_install_is_the_module_not_the_missing_attribute(tmp_path, spec, named):
    """A run's spec that needs a name a module here lacks: the remedy names that module to install, for a worker
    and for the scheduler (it named the attribute: ``install module 'gelu_new' on every worker``).  A real store
    whose spec file unpickles so; no processes."""
    import pickle
    from types import SimpleNamespace

    from vcdask import _worker_spec
    from vcdask.engine import plugin
    from vcdask.errors import SchedulerEnvironmentError, WorkerEnvironmentError
    from vcdask.spec import spec_path

    store = vcdask.open_store(str(tmp_path / "s"))
    run_id = f"run-{uuid.uuid4().hex[:6]}"
    store.files.put(spec_path(run_id), pickle.dumps(spec))
    with pytest.raises(WorkerEnvironmentError) as raised:
        _worker_spec.run_spec(store, run_id, lambda: "tcp://127.0.0.1:1")
    assert f"install {named}" in str(raised.value), raised.value
    scheduler = SimpleNamespace(scheduler=SimpleNamespace(address="tcp://127.0.0.1:2"))
    with pytest.raises(SchedulerEnvironmentError) as raised_there:
        plugin.VcdaskPlugin._load_spec(scheduler, store, run_id)
    message = str(raised_there.value)
    assert f"install {named}" in message and "where the scheduler runs" in message, message
