"""Where a benchmark keeps its parameter store: a scratch directory removed at exit, unless ``--store`` names one.

A benchmark commits one version per merge; at a few MB per version a single run leaves gigabytes behind, so the
default is a temporary directory that is deleted when the benchmark ends (also on error or Ctrl-C).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator


def add_store_argument(ap) -> None:
    ap.add_argument(
        "--store", default=None, help="keep the parameter store here (default: a temporary directory removed at exit)"
    )


@contextlib.contextmanager
def scratch_store(path: str | None, name: str) -> Iterator[str]:
    """Yield ``path`` as is, or a fresh temporary directory (prefix ``vcdask-bench-<name>-``) removed afterwards."""
    if path is not None:
        yield path
        return
    d = tempfile.mkdtemp(prefix=f"vcdask-bench-{name}-")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
