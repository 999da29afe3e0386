"""Following a run: the console display, and :func:`make_progress`, which picks one.

:func:`make_progress` picks a display: the live notebook panel (:mod:`vcdask.panel`) in Jupyter,
a tqdm bar with log lines elsewhere.  Both follow the run's events (its Dask topic,
:func:`vcdask.engine.events.topic`, through :func:`vcdask._topics.follow`: any number of displays of a run
on one client follow it side by side); the console form prints the notable ones (re-issues, lost or
excluded workers, store pauses) as concise lines above its bar.  Nothing here imports ipywidgets.
"""

from __future__ import annotations

import logging
import sys

from ._topics import Following, follow
from .engine.events import topic
from .panel_state import PanelState

__all__ = ["ConsoleProgress", "PanelState", "make_progress"]

logger = logging.getLogger(__name__)


class _NoProgress:
    def update(self, status: dict) -> None:
        pass

    def close(self, status: dict | None = None) -> None:
        pass


class ConsoleProgress:
    """A tqdm bar (one unit per epoch; the postfix shows merges in the epoch and the last metrics),
    with a line for each notable event of the run.

    Redrawn when what it shows changes; where stderr is no terminal (a scheduled job's log, CI), at most
    every :data:`LOG_INTERVAL` seconds and at each epoch: each redraw there is a line of the log (two a
    second, the same but for the clock, came to about 1 MB an hour).
    """

    #: Seconds between redraws of a bar written to a log, not a terminal.
    LOG_INTERVAL = 30.0

    def __init__(self, handle) -> None:
        from tqdm.auto import tqdm

        status = handle.status()
        self._tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
        self.bar = tqdm(
            total=status["max_epochs"],
            unit="epoch",
            desc=status["run_id"],
            leave=True,
            mininterval=0.1 if self._tty else self.LOG_INTERVAL,
        )
        self._shown: dict | None = None
        self.done = 0
        self.client = handle.client
        self.topic = topic(handle.run_id)
        self.state = PanelState(handle.run_id)
        self._following: Following | None = None
        try:
            self._following = follow(self.client, self.topic, self._on_event)
        except Exception:
            logger.debug("could not subscribe to %s", self.topic, exc_info=True)

    def _on_event(self, event) -> None:
        before = list(self.state.notes)
        self.state.apply(event[1])
        for note in self.state.notes:
            if note not in before:
                self.bar.write(f"vcdask {self.state.run_id}: {note}")

    def update(self, status: dict) -> None:
        done = status["epochs_done"]
        advanced = done > self.done
        if advanced:
            self.bar.update(done - self.done)
            self.done = done
        post = {"merged": f"{status['merged_in_epoch']}/{status['n_shards']}", "v": status["step"]}
        for k, v in (status.get("last_epoch") or {}).items():
            if k in ("epoch", "version", "wall_time", "skipped") or k.endswith(("_mean", "_min", "_max")):
                continue
            post[k] = f"{v:.4f}"
        if status.get("paused"):
            post["paused"] = status.get("paused_cause") or "store"
        if post != self._shown:
            self._shown = post
            self.bar.set_postfix(post, refresh=self._tty or advanced)

    def close(self, status: dict | None = None) -> None:
        """Stop following events (other displays of the run go on) and close the bar."""
        if self._following is not None:
            self._following.close()
        self.bar.close()


def make_progress(handle, enabled: bool = True):
    """The progress display for ``handle``'s run: a :class:`~vcdask.panel.RunPanel` in a Jupyter
    kernel, a :class:`ConsoleProgress` elsewhere, nothing when ``enabled`` is False."""
    if not enabled:
        return _NoProgress()
    from .panel import RunPanel, in_kernel

    if in_kernel():
        try:
            return RunPanel(handle)
        except ImportError as e:  # ipywidgets / bokeh / jupyter_bokeh missing: fall back to the bar
            logger.warning(
                "the notebook panel needs ipywidgets, bokeh and jupyter_bokeh (%s); showing a progress bar instead", e
            )
    return ConsoleProgress(handle)
