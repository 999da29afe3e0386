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
