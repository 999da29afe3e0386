"""Several threads and processes open-or-create the same new store at once: all succeed, on one repository."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from vcdask import open_store
from vcdask.store._memory import MemoryBackend

N_THREADS = 6
N_PROCESSES = 3


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def new_location(request, tmp_path):
    """(location, storage options) of a store that does not exist yet."""
    if request.param == "local":
        yield str(tmp_path / "parent" / "store"), {}
    elif request.param == "memory":
        name = f"memory://{uuid.uuid4().hex}"
        yield name, {}
        MemoryBackend.forget(name)
    else:
        s3 = request.getfixturevalue("s3")
        yield f"s3://{s3.new_bucket()}/store", s3.options()


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def new_shared_location(request, tmp_path):
    """Like ``new_location``, for backends that several processes can open."""
    if request.param == "local":
        yield str(tmp_path / "parent" / "store"), {}
    else:
        s3 = request.getfixturevalue("s3")
        yield f"s3://{s3.new_bucket()}/store", s3.options()


def _commit_own_branch(store, opener: int) -> str:
    """Opener ``opener`` commits the value ``opener`` to its own new branch; the version id."""
    branch = f"opener-{opener}"
    store.create_branch(branch)
    return store.commit({"w": torch.full((8,), float(opener))}, {"opener": opener}, branch=branch)


def assert_one_repository(loc: str, options: dict, landed: dict[int, str], handles=()) -> None:
    """A fresh handle sees every opener's branch at the version it committed, reading back its value;
    so does every opener's own handle (they all opened one repository)."""
    fresh = open_store(loc, mode="r", **options)
    branches = fresh.branches()
    assert branches == {"main": None, **{f"opener-{i}": v for i, v in landed.items()}}
    for i, version in landed.items():
        checkpoint = fresh.read(branch=f"opener-{i}")
        assert checkpoint.version == version
        assert checkpoint.metadata == {"opener": i}
        assert torch.equal(checkpoint.state_dict()["w"], torch.full((8,), float(i)))
    for handle in handles:
        assert handle.branches() == branches


def test_threads_create_one_store(new_location):
    loc, options = new_location
    start = threading.Barrier(N_THREADS)

    def opener(i: int):
        start.wait(timeout=60)
        return open_store(loc, **options)  # each thread its own handle, like concurrent fit() calls

    with ThreadPoolExecutor(N_THREADS) as pool:
        stores = list(pool.map(opener, range(N_THREADS)))  # raises what any opener raised
    assert len(stores) == N_THREADS
    with ThreadPoolExecutor(N_THREADS) as pool:
        versions = list(pool.map(_commit_own_branch, stores, range(N_THREADS)))
    assert len(set(versions)) == N_THREADS
    assert_one_repository(loc, options, dict(enumerate(versions)), stores)


def _open_in_child(loc: str, options: dict, opener: int, start, results) -> None:
    """A spawned process: open-or-create at the barrier, then commit to its own branch."""
    try:
        start.wait(timeout=120)
        store = open_store(loc, **options)
        results.put((opener, "ok", _commit_own_branch(store, opener)))
    except Exception as e:  # noqa: BLE001 - the test process reports it
        results.put((opener, "error", f"{type(e).__name__}: {e}"))


@pytest.mark.slow
def test_processes_create_one_store(new_shared_location):
    loc, options = new_shared_location
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(N_PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_open_in_child, args=(loc, options, i, start, results)) for i in range(N_PROCESSES)]
    for p in procs:
        p.start()
    try:
        outcomes = [results.get(timeout=240) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
    errors = [o for o in outcomes if o[1] != "ok"]
    assert not errors, errors
    assert [p.exitcode for p in procs] == [0] * N_PROCESSES
    landed = {i: v for i, _, v in outcomes}
    assert sorted(landed) == list(range(N_PROCESSES))
    assert_one_repository(loc, options, landed)
