"""The README's first command: `vcdask demo` trains on the embedded default and reports accuracy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from vcdask.cli import demo_verdict

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def test_demo_console_command(tmp_path):
    """As the README's user runs it: on Dask's default start method, spawn, and with Dask's worker profiler
    (conftest.py forks the suite's other workers and turns the profiler off)."""
    store = tmp_path / "runs"
    suite_only = {"DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD", "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"}
    env = {k: v for k, v in os.environ.items() if k not in suite_only}
    proc = subprocess.run(
        [sys.executable, "-m", "vcdask.cli", "demo", "--store", str(store), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", proc.stdout).group(1))
    assert accuracy >= 0.95
    # what the run decided for what the demo left to it: the rule of its alpha, the optimizer state
    said = r"trained with: merge vc-asgd; (inner optimizer kept per worker|a fresh inner optimizer per task); 10 shards"
    assert re.search(said + r" of \d+ local steps", proc.stdout)
    seconds = float(re.search(r"merges in ([0-9.]+) s", proc.stdout).group(1))
    assert seconds < 120
    folder = Path(re.search(r"history, epochs and plot: (.+)/\n", proc.stdout).group(1))
    folder = folder if folder.is_absolute() else tmp_path / folder
    history = pd.read_csv(folder / "history.csv")
    assert history.accepted.sum() == 20 * 10
    assert (folder / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"store: {store}" in proc.stdout
    # the "load it again" line runs as printed, in a fresh process that has no model of its own
    line = re.search(r"load it again: (model = vcdask\.load\(.+?\))", proc.stdout).group(1)
    check = f"import vcdask\n{line}\nprint(sum(p.numel() for p in model.parameters()))"
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert loaded.returncode == 0 and int(loaded.stdout) > 1000, loaded.stderr


def test_demo_into_a_file_url_store_writes_its_files_beside_the_run(tmp_path):
    """``--store file:///abs/path`` (percent-encoded): the history, epochs and plot go beside the run in that
    store, written through its files; nothing appears in the working directory (a ``file:`` folder)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    url = (tmp_path / "my runs").as_uri()  # file:///.../my%20runs
    proc = subprocess.run(
        [sys.executable, "-m", "vcdask.cli", "demo", "--store", url, "--max-epochs", "1", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: one epoch is under the demo's bar
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)\n", proc.stdout).group(1))
    code, why = demo_verdict(accuracy, 1)  # exit 1 under the bar, with its line on stderr
    assert proc.returncode == code and (why is None or why in proc.stderr), (accuracy, proc.returncode, proc.stderr)
    folder = Path(re.search(r"history, epochs and plot: (.+)/\n", proc.stdout).group(1))
    assert folder.parent == tmp_path / "my runs" / "runs", proc.stdout
    assert len(pd.read_csv(folder / "history.csv")) == 10 and len(pd.read_csv(folder / "epochs.csv")) == 1
    assert (folder / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(cwd.iterdir()) == []
