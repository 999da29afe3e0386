"""examples/*.py run as subprocesses, as a scheduled job would run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import vcdask

EXAMPLES = Path(__file__).parents[1] / "examples"
pytestmark = pytest.mark.slow


def _run(script: str, *args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_retrain_from_tag_twice(tmp_path):
    store = str(tmp_path / "store")
    first = _run("retrain_from_tag.py", "--store", store, "--epochs", "4", cwd=tmp_path)
    assert "no release yet" in first
    second = _run("retrain_from_tag.py", "--store", store, "--epochs", "2", "--seed", "1", cwd=tmp_path)
    v1 = re.search(r"tagged release-1 = version (\w+)", first).group(1)
    assert f"starting from release-1 (version {v1})" in second
    tags = vcdask.open_store(store, mode="r").tags()
    assert tags["release-1"] == v1
    assert set(tags) == {"release-1", "release-2"}
    before, after = map(float, re.search(r"test accuracy ([0-9.]+) -> ([0-9.]+)", second).groups())
    assert before > 0.5  # it really started from the released model (a fresh one scores ~0.1)
    assert after > 0.8
