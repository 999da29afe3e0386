"""Where a store may be: file:// URLs as pathlib writes them, paths under a file, a read-only filesystem,
and an Icechunk repository that is not a vcdask store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import icechunk
import numpy as np
import pytest
import torch
import zarr

from vcdask import open_store
from vcdask.errors import (
    InvalidLocationError,
    StoreAccessDeniedError,
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
)


# -- file:// URLs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        lambda p: p.as_uri(),  # file:///.../my%20runs/mod%C3%A8les
        lambda p: "file://localhost" + p.as_uri()[len("file://") :],
        lambda p: f"FILE://{p}",  # the scheme in any case, the path as written
    ],
    ids=["as_uri", "localhost", "upper-case"],
)
def test_a_file_url_opens_the_directory_it_names(tmp_path, url):
    path = tmp_path / "my runs" / "modèles"
    store = open_store(path)
    v = store.commit(torch.nn.Linear(2, 2), {"e": 1})
    store.tag("best", v)
    before = sorted(os.listdir(tmp_path))
    again = open_store(url(path), mode="r")
    assert again.location == str(path)
    assert again.tags() == {"best": v} and again.read(tag="best").metadata == {"e": 1}
    assert sorted(os.listdir(tmp_path)) == before  # no new store at the literal (still encoded) path
    assert open_store(url(path)).head() == v  # mode="a" opens the same store, creates nothing


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("file://server/share/runs", "names the host 'server'"),
        ("file://relative-dir", "names the host 'relative-dir'"),
        ("file:///tmp/runs?version=2", "has a query or fragment"),
        ("file:///tmp/run#1", "has a query or fragment"),
        ("file://", "has no path"),
    ],
)
def test_a_file_url_that_names_no_local_path_is_refused(tmp_path, monkeypatch, url, problem):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidLocationError, match=problem) as info:
        open_store(url)
    assert repr(url) in str(info.value)
    assert "file:///abs/path" in str(info.value) or "%23" in str(info.value)
    assert not os.listdir(tmp_path)  # nothing created, e.g. ./server/share/runs


# -- a path under a file --------------------------------------------------------------------------------------
@pytest.mark.parametrize("below", ["sub", "sub/deeper"])
@pytest.mark.parametrize("mode", ["a", "r", "r+", "w-"])
def test_a_path_under_a_file_is_not_a_store(tmp_path, below, mode):
    (tmp_path / "afile").write_text("x")
    # Icechunk panics there (pyo3_runtime.PanicException, a BaseException that `except Exception` misses)
    with pytest.raises(StoreNotFoundError, match=r"'.*afile' is a file, not a directory"):
        open_store(tmp_path / "afile" / below, mode=mode)
    assert (tmp_path / "afile").read_text() == "x"


# -- a commit that cannot take the store's lock ---------------------------------------------------------------
def test_a_commit_lock_that_cannot_be_taken_is_a_store_error(tmp_path):
    store = open_store(tmp_path / "s")
    v = store.commit({"w": torch.zeros(3)})
    lock = tmp_path / "s" / ".vcdask-commit.lock"
    lock.unlink()
    lock.mkdir()  # (what a read-only filesystem does to the lock's os.open, for any user: an OSError)
    with pytest.raises(StoreError, match=r"taking the commit lock '.*\.vcdask-commit\.lock' of local directory"):
        store.commit({"w": torch.ones(3)})
    assert store.head() == v


_READ_ONLY_CHILD = """
import json, sys, torch, vcdask
out = {}
for mode in ("a", "r+"):
    store = vcdask.open_store(sys.argv[1], mode=mode)
    try:
        store.commit({"w": torch.ones(3)})
        out[mode] = "committed"
    except Exception as e:
        out[mode] = [type(e).__name__, isinstance(e, PermissionError), str(e), store.head()]
try:  # a new store there (Icechunk panicked: a BaseException)
    vcdask.open_store(sys.argv[1] + "/new/store")
except BaseException as e:
    out["create"] = [type(e).__name__, isinstance(e, PermissionError), str(e)]
print(json.dumps(out))
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) for a read-only mount")
def test_a_commit_or_a_new_store_on_a_read_only_filesystem_is_access_denied(tmp_path):
    """A real read-only filesystem: the store's directory bind-mounted read-only in a private mount namespace
    of a child (``unshare -rm``: an unprivileged user namespace, or root's)."""
    path = tmp_path / "s"
    v = open_store(path).commit({"w": torch.zeros(3)})
    mount = f"mount --bind '{path}' '{path}' && mount -o remount,bind,ro '{path}' || exit 97"
    child = f"{mount}; exec '{sys.executable}' -c '{_READ_ONLY_CHILD}' '{path}'"
    done = subprocess.run(["unshare", "-rm", "sh", "-c", child], capture_output=True, text=True, timeout=120)
    if done.returncode == 97 or "unshare:" in done.stderr:
        pytest.skip(f"no read-only bind mount here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for mode in ("a", "r+"):
        name, is_permission_error, message, head = out[mode]
        assert name == StoreAccessDeniedError.__name__ and is_permission_error, out
        assert "Read-only file system" in message and "open it with mode='r'" in message
        assert head == v
    name, is_permission_error, message = out["create"]
    assert name == StoreAccessDeniedError.__name__ and is_permission_error, out
    assert message == (
        f"cannot create a store at local directory '{path}/new/store': '{path}' may not be written (a read-only "
        "filesystem, or permissions)"
    )


# -- an Icechunk repository that is not a vcdask store ---------------------------------------------------------
def _dataset_repository(storage: icechunk.Storage) -> tuple[icechunk.Repository, str]:
    """A user's own repository: a dataset committed on its main."""
    repo = icechunk.Repository.create(storage)
    session = repo.writable_session("main")
    group = zarr.group(session.store)
    group.attrs["owner"] = "me"
    group.create_array("temperature", shape=(4,), dtype="f8")[:] = np.arange(4.0)
    return repo, session.commit("my data")


def _untouched(repo: icechunk.Repository, snapshot: str) -> None:
    repo = repo.reopen()
    assert repo.lookup_branch("main") == snapshot and repo.list_branches() == {"main"}
    group = zarr.open_group(repo.readonly_session(snapshot_id=snapshot).store, mode="r")
    assert list(group.keys()) == ["temperature"] and dict(group.attrs) == {"owner": "me"}


@pytest.mark.parametrize("mode", ["a", "r", "r+"])
def test_an_icechunk_repository_that_is_not_a_store_is_refused(tmp_path, mode):
    repo, snapshot = _dataset_repository(icechunk.local_filesystem_storage(str(tmp_path / "data")))
    with pytest.raises(StoreNotFoundError, match=r"holds an Icechunk repository that is not a vcdask store") as info:
        open_store(tmp_path / "data", mode=mode)
    assert snapshot in str(info.value) and "'my data'" in str(info.value)
    assert info.value.missing is None  # something is there (a job must not take it for a store to create)
    with pytest.raises(StoreExistsError):
        open_store(tmp_path / "data", mode="w-")
    _untouched(repo, snapshot)


def test_an_empty_icechunk_repository_and_a_store_with_versions_open(tmp_path):
    icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "empty")))
    assert open_store(tmp_path / "empty").head() is None  # as vcdask creates a store: nothing to tell apart
    store = open_store(tmp_path / "s")
    v = store.commit({"w": torch.zeros(3)})
    store.create_branch("other")  # main at a version, another branch at the root
    assert open_store(tmp_path / "s", mode="r").head() == v


@pytest.mark.s3
def test_an_icechunk_repository_on_s3_that_is_not_a_store_is_refused(s3):
    bucket = s3.new_bucket()
    storage = s3.icechunk_storage(bucket, "data")
    repo, snapshot = _dataset_repository(storage)
    with pytest.raises(StoreNotFoundError, match="not a vcdask store"):
        open_store(f"s3://{bucket}/data", **s3.options())
    _untouched(repo, snapshot)
