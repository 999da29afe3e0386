"""Watching a training process (a script, a `vcdask train` job) from outside, through its store."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import vcdask
from vcdask.cli._listing import run_ids, run_info
from vcdask.errors import StoreNotFoundError


def wait_for_merges(store_path: Path, proc: subprocess.Popen, at_least: int = 3, timeout: float = 120) -> str:
    """The id of the run ``proc`` trains into the store at ``store_path``, once it has merged ``at_least``
    versions.  The store is opened read-only: the process may not have created it yet, or be creating it
    (its directory comes before its repository), and either is "not yet"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            store = vcdask.open_store(store_path, mode="r")
        except StoreNotFoundError:
            pass
        else:
            ids = run_ids(store)
            if ids and (run_info(store, ids[0])["step"] or 0) >= at_least:
                return ids[0]
        time.sleep(0.5)
    raise TimeoutError(f"the process's run never merged {at_least} versions within {timeout:g} s")
