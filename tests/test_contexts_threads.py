"""The missing ``__main__`` guard of a script that calls ``fit`` from a thread it starts at its top level: refused
before any worker process starts, as a call from the top level itself is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import vcdask

SCRIPT = """
import threading

import numpy as np
import torch
import vcdask

X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = (X[:, 0] > 0).astype("int64")
heard = []


def train():
    try:
        result = vcdask.fit(torch.nn.Linear(4, 2), (X, y), max_epochs=1, store="store", progress=False)
        print("merges", int(result.history["accepted"].sum()))
    except Exception as e:
        heard.append(e)


{start}
"""
START = """trainer = threading.Thread(target=train, name="trainer")
trainer.start()
trainer.join()
if heard:
    raise SystemExit(f"{type(heard[0]).__name__}: {heard[0]}")
"""


def _script(tmp_path, start, method):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(start=start))
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD": method}
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env
    )


def test_a_script_that_calls_fit_in_a_thread_without_the_main_guard_is_refused_before_any_worker_starts(tmp_path):
    """The check walked the calling thread's stack only: the script's workers, spawned, each ran the script
    again, called fit themselves, and failed ("Nanny failed to start")."""
    proc = _script(tmp_path, START, "spawn")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("MainGuardError: vcdask started its embedded cluster")
    line = SCRIPT.format(start=START).splitlines().index("trainer.join()") + 1  # (where the main thread is)
    assert f"top level of {tmp_path / 'train.py'} (line {line}) (in thread 'trainer', which it started)" in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr and "Nanny failed to start" not in proc.stderr
    store = vcdask.open_store(str(tmp_path / "store"))  # nothing staged for a cluster that would not start
    assert "merges" not in proc.stdout and [b for b in store.branches() if b.startswith("run-")] == []
    assert store.files.list("") == [] and not list(tmp_path.glob("store/**/run-*"))


@pytest.mark.cluster
@pytest.mark.slow
def test_a_script_that_calls_fit_in_a_thread_under_the_main_guard_trains(tmp_path):
    guarded = 'if __name__ == "__main__":\n' + textwrap.indent(START, "    ")
    proc = _script(tmp_path, guarded, os.environ.get("DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD", "spawn"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["merges", "4"]  # 2 workers, 2 shards each
