"""Ctrl-C and SIGTERM while a job runs, and after it has ended.

While the job trains, both raise :class:`KeyboardInterrupt` in the main thread: ``fit`` stops the run (its
merged work committed), and the job exits 130.  Once the job has ended (its report being written, its
cluster closing), another one is noted and ignored: the process exits with the code its report gives, and
does not die half-way, by SIGTERM's default action (rc 143), while it writes the report or closes its cluster.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["Interrupts"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """SIGINT and SIGTERM in the main thread: :class:`KeyboardInterrupt` until :meth:`hold`, then ignored
    (a line on stderr says so) until :meth:`restore` puts back the handlers it replaced.

    Off the main thread nothing changes (Python delivers signals to the main thread only).

    Parameters
    ----------
    held : bool, default False
        Start held: ``vcdask train`` holds them around the job, from its end until its cluster is closed.
    """

    def __init__(self, held: bool = False):
        self.held = held
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def hold(self) -> None:
        """From now on, ignore them: the job has ended."""
        self.held = True

    def restore(self) -> None:
        """Put back the handlers these replaced."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.held:
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        line = f"vcdask: {name} ignored: the job has ended; it writes its report, closes its cluster, and exits"
        # not print(): the main thread may be inside a write to sys.stderr
        os.write(2, f"{line} with the report's exit code\n".encode())
