"""Concurrent writers and crashed writers never lose, duplicate or tear a version."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from vcdask import open_store
from vcdask.errors import StoreConflict
from vcdask.store._memory import MemoryBackend

WRITER = str(Path(__file__).with_name("commit_writer.py"))


def _location(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "store"), {}
    elif request.param == "memory":
        name = f"memory://{uuid.uuid4().hex}"
        yield name, {}
        MemoryBackend.forget(name)
    else:
        s3 = request.getfixturevalue("s3")
        yield f"s3://{s3.new_bucket()}/store", s3.options()


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def location(request, tmp_path):
    """(location, storage options) of a fresh store of each backend."""
    yield from _location(request, tmp_path)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def shared_location(request, tmp_path):
    """Like ``location``, for backends that several processes can open."""
    yield from _location(request, tmp_path)


def assert_history_accounts_for(store, landed: dict[str, tuple[int, int]]) -> None:
    """History == exactly the landed commits, each once, each reading back what its writer wrote."""
    history = store.versions()
    ids = [v.id for v in history]
    assert len(ids) == len(set(ids)), "a version appears twice in the history"
    assert set(ids) == set(landed), f"history {ids} != landed {sorted(landed)}"
    for info in history:
        writer, i = info.metadata["writer"], info.metadata["i"]
        assert landed[info.id] == (writer, i)
        state = store.read(info.id).state_dict()
        expected = writer * 1000 + i
        assert torch.all(state["w"] == expected), f"version {info.id} is torn"
        assert state["tag"].item() == expected


def _state(value: int, size: int) -> dict:
    return {"w": torch.full((size,), float(value)), "tag": torch.tensor([value])}


def test_two_threads_commit_to_one_branch(location):
    loc, options = location
    open_store(loc, **options)  # create it once, as a run does
    n, size = 6, 200_000
    start = threading.Barrier(2)

    def writer(w: int) -> list[tuple[int, str | None]]:
        store = open_store(loc, **options)  # each thread its own handle, like two clients
        start.wait()
        out = []
        for i in range(n):
            try:
                out.append((i, store.commit(_state(w * 1000 + i, size), {"writer": w, "i": i})))
            except StoreConflict:
                out.append((i, None))
        return out

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(writer, [1, 2]))
    landed = {v: (w, i) for w, res in zip([1, 2], results, strict=True) for i, v in res if v is not None}
    conflicts = sum(v is None for res in results for _, v in res)
    assert len(landed) + conflicts == 2 * n
    assert len(landed) == 2 * n, "with retries every commit should land"
    assert_history_accounts_for(open_store(loc, **options), landed)


def _spawn_writer(loc: str, options: dict, writer: int, n: int, size: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, WRITER, loc, str(writer), str(n), str(size), json.dumps(options)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_two_processes_commit_to_one_branch(shared_location):
    loc, options = shared_location
    open_store(loc, **options)
    n = 6
    procs = {w: _spawn_writer(loc, options, w, n, 200_000) for w in (1, 2)}
    landed, conflicts = {}, 0
    for w, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        for line in out.splitlines():
            rec = json.loads(line)
            if "version" in rec:
                landed[rec["version"]] = (w, rec["i"])
            else:
                conflicts += 1
    assert len(landed) + conflicts == 2 * n
    assert len(landed) == 2 * n
    assert_history_accounts_for(open_store(loc, **options), landed)


@pytest.mark.slow
def test_writer_killed_mid_commit_leaves_last_good_version(shared_location):
    loc, options = shared_location
    open_store(loc, **options)
    rng = random.Random(1234)
    landed: dict[str, tuple[int, int]] = {}
    for writer in (1, 2, 3):
        proc = _spawn_writer(loc, options, writer, 0, 3_000_000)  # 12 MB per version, commits forever
        seen = 0
        try:
            for line in proc.stdout:  # let a couple of versions land, then kill at a random moment
                rec = json.loads(line)
                landed[rec["version"]] = (writer, rec["i"])
                seen += 1
                if seen == 2:
                    break
            time.sleep(rng.uniform(0.0, 0.15))
            os.kill(proc.pid, signal.SIGKILL)
            for line in proc.stdout.read().splitlines():  # lines printed before the kill
                rec = json.loads(line)
                landed[rec["version"]] = (writer, rec["i"])
        finally:
            proc.wait(30)
        assert proc.returncode == -signal.SIGKILL
        store = open_store(loc, **options)
        # At most one more commit may have landed after its line was read but before the kill.
        history = store.versions()
        extra = {v.id: (v.metadata["writer"], v.metadata["i"]) for v in history if v.id not in landed}
        assert len(extra) <= 1
        landed.update(extra)
        assert_history_accounts_for(store, landed)
        head = store.read()
        assert head.version == history[0].id
    # The lock of a killed writer is gone: a new commit lands at once.
    v = open_store(loc, **options).commit(_state(9000, 10), {"writer": 9, "i": 0})
    assert open_store(loc, **options).head() == v
