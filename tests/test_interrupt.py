"""Ctrl-C in a script stops the run as the docs say: merged work committed, the run listed as stopped, the
embedded cluster closed without a warning (issue 40); SIGTERM does the same to a ``vcdask train`` job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from process_helpers import wait_for_merges

import vcdask
from vcdask.cli._listing import run_info

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import sys

    import numpy as np
    import torch

    import vcdask

    if __name__ == "__main__":
        rng = np.random.default_rng(0)
        X = rng.random((4000, 8), dtype=np.float32)
        y = (X.sum(axis=1) > 4).astype(np.int64)
        torch.manual_seed(0)
        vcdask.fit(torch.nn.Linear(8, 2), (X, y), max_epochs=100000, n_shards=4, store=sys.argv[1], progress=False)
    """
)


def _ctrl_c_as_at_a_terminal() -> None:
    """SIGINT's default disposition in the script (a suite started in the background of a shell inherits
    SIGINT ignored, and so would the script: Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_a_script_stops_the_run_and_commits_what_it_merged(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    store_path = tmp_path / "store"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(store_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, cwd=tmp_path, preexec_fn=_ctrl_c_as_at_a_terminal,
    )  # fmt: skip
    try:
        run_id = wait_for_merges(store_path, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err and f"stopping run {run_id}" in err, err[-3000:]
    assert "close_embedded()" not in err and "still going" not in err, err[-3000:]
    store = vcdask.open_store(store_path)
    info = run_info(store, run_id)
    assert info["status"].startswith("stopped"), info
    assert 3 <= info["step"] and info["epochs"] < 100000
    model = vcdask.load(store, version=info["version"])  # the merged work loads
    assert sum(p.numel() for p in model.state_dict().values()) == 18


STARTING = textwrap.dedent(
    """
    import multiprocessing.forkserver
    import os
    import signal
    import sys
    import threading
    import time

    import dask
    import numpy as np
    import psutil
    import torch

    import vcdask


    def workers():
        \"\"\"This process's worker processes, named by what they are, not by what they are not: a child caught
        between its fork and its exec (the fork server, the resource tracker, as they start) has this script's
        command line, and was once taken for a worker, so the Ctrl-C came before the cluster's start.\"\"\"
        server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
        found = []
        for p in psutil.Process().children(recursive=True):
            try:
                forked = server is not None and p.ppid() == server  # a worker forked from the fork server
                if forked or "spawn_main" in " ".join(p.cmdline()):  # ... or spawned (Dask's default)
                    found.append(p.pid)
            except psutil.Error:
                pass
        return found


    def ctrl_c_once_a_worker_starts():
        while not workers():
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGINT)


    if __name__ == "__main__":
        # (each worker takes 5 s more to start, so Ctrl-C comes while the cluster starts: on a busy machine a
        # worker process appeared, and the cluster was up, before this thread had seen it)
        slow = "import time\\ndef dask_setup(worker):\\n    time.sleep(5)\\n"
        dask.config.set({"distributed.worker.preload": [slow]})
        threading.Thread(target=ctrl_c_once_a_worker_starts, daemon=True).start()
        X = np.random.default_rng(0).random((64, 8), dtype=np.float32)
        try:
            vcdask.fit(torch.nn.Linear(8, 2), (X, (X[:, 0] > 0.5).astype(np.int64)), max_epochs=1, store=sys.argv[1],
                       progress=False)
            print("fit returned")
        except KeyboardInterrupt:
            print("interrupted")
        time.sleep(3)  # (a start left going has its workers up by now)
        print("workers", len(workers()))
    """
)


def test_ctrl_c_while_the_embedded_cluster_starts_leaves_no_cluster_running(tmp_path):
    """Ctrl-C inside ``LocalCluster``'s start left its workers starting on distributed's event loop: the next
    fit started a second cluster, and the exit's clean-up failed on the first (an ``AssertionError``)."""
    script = tmp_path / "train.py"
    script.write_text(STARTING)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True, timeout=180,
        cwd=tmp_path, preexec_fn=_ctrl_c_as_at_a_terminal,
    )  # fmt: skip
    assert proc.stdout.split() == ["interrupted", "workers", "0"], proc.stdout + proc.stderr[-3000:]
    assert "closing it once it is up" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
