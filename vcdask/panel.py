"""The live progress panel of a run in Jupyter: ipywidgets + bokeh, fed by the run's events.

The scheduler plugin pushes small event records on the run's Dask topic
(:func:`vcdask.engine.events.topic`: shard states, merges, epochs, worker changes, pauses).  A panel
follows that topic (through :func:`vcdask._topics.follow`, so that other panels and a progress bar of the
run on the same client follow it too), takes one snapshot of the run (so it can start, or re-attach,
mid-run) and folds every event into :class:`~vcdask.panel_state.PanelState`; the widgets render that
state.  A panel of a run that has already ended shows its final state and follows nothing.  Nothing here
polls the store.
ipywidgets, bokeh and jupyter_bokeh are imported only when a panel is made.
"""

from __future__ import annotations

import contextlib
import html
import threading
import time

from ._topics import follow
from .engine.events import ShardState, topic
from .panel_state import PanelState, ended_snapshot

__all__ = ["PanelState", "RunPanel", "in_kernel", "load_bokehjs"]

SHARD_COLORS: dict[ShardState, str] = {
    "queued": "#d9d9d9",
    "running": "#4c9be8",
    "re-issued": "#f0a630",
    "merged": "#3aa35b",
    "rejected": "#d9534f",
    "skipped": "#7f7f7f",
}
_COLORS: dict[str, str] = {str(k): v for k, v in SHARD_COLORS.items()}  # snapshots carry plain strings
_RENDER_INTERVAL = 0.25  # seconds: events are folded at once, the widgets redrawn at most this often


def in_kernel() -> bool:
    """Whether the code runs in a Jupyter kernel (where widgets can display)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


_bokehjs_loaded = False


def load_bokehjs() -> None:
    """Load BokehJS into the notebook page, once per kernel, from the installed bokeh package
    (inline: no CDN, which offline machines and some JupyterHubs cannot reach).  The bokeh
    widgets (jupyter_bokeh) draw with it."""
    global _bokehjs_loaded
    if _bokehjs_loaded:
        return
    from bokeh.io import output_notebook
    from bokeh.resources import INLINE

    output_notebook(INLINE, hide_banner=True)
    _bokehjs_loaded = True


class RunPanel:
    """The live panel of one run, as ipywidgets (with a bokeh plot).

    Parameters
    ----------
    handle : RunHandle
        The run to follow.
    display : bool, default True
        Display the panel at once (in a notebook cell's output).

    Attributes
    ----------
    state : PanelState
        What the panel shows.
    progress : ipywidgets.IntProgress
        Epochs done out of ``max_epochs``.
    source : bokeh.models.ColumnDataSource
        The metric plot's data: one row per finished epoch (``time``, ``value``, ``lo``, ``hi``).
    widget : ipywidgets.VBox
        The whole panel.
    """

    def __init__(self, handle, display: bool = True):
        import ipywidgets as w
        from bokeh.models import ColumnDataSource
        from bokeh.plotting import figure
        from jupyter_bokeh import BokehModel

        if display:
            load_bokehjs()
        self.handle = handle
        self.client = handle.client
        self.topic = topic(handle.run_id)
        self.state = PanelState(handle.run_id)
        self._lock = threading.RLock()
        self._last_render = 0.0
        self._render_pending = False
        self._ready = False  # the widgets exist: events before only fold into the state
        self._closed = False
        # a run that ended, its handle's client closed: what the handle kept is all there is to show
        self._kept = ended_snapshot(handle)
        # follow, then snapshot: events racing the snapshot are harmless (absolute values)
        self._following = None if self._kept is not None else follow(self.client, self.topic, self._on_event)
        with contextlib.ExitStack() as undo:  # a snapshot that fails (no such run) leaves no follower behind
            if self._following is not None:
                undo.callback(self._following.close)
            self.state.apply_snapshot(self._snapshot())
            undo.pop_all()
        metric = self.state.metric

        self.header = w.HTML()
        self.progress = w.IntProgress(
            value=0, min=0, max=1, description="epochs", bar_style="info", layout=w.Layout(width="80%")
        )
        self.progress_label = w.HTML()
        self.grid_html = w.HTML()
        self.workers_html = w.HTML()
        self.notes_html = w.HTML()
        self.source = ColumnDataSource(data={"epoch": [], "time": [], "value": [], "lo": [], "hi": []})
        fig = figure(
            height=240,
            width=460,
            x_axis_label="wall time (s)",
            y_axis_label=metric,
            title=(
                "training loss by epoch (no validation data: nothing is validated)"
                if metric == "train_loss"
                else f"validation {metric} by epoch (band: min/max in the epoch)"
            ),
            toolbar_location=None,
        )
        fig.varea(x="time", y1="lo", y2="hi", source=self.source, fill_alpha=0.25, fill_color="#4c9be8")
        fig.line(x="time", y="value", source=self.source, line_width=2, color="#1f5fa8")
        fig.scatter(x="time", y="value", source=self.source, size=6, color="#1f5fa8")
        fig.title.text_font_size = "10pt"  # type: ignore[union-attr]  # figure(title=...) makes a Title
        self.figure = fig
        self.plot = BokehModel(fig)
        left = w.VBox([self.grid_html, self.workers_html], layout=w.Layout(width="50%"))
        right = w.VBox([self.plot], layout=w.Layout(width="50%"))
        self.widget = w.VBox(
            [self.header, w.HBox([self.progress, self.progress_label]), w.HBox([left, right]), self.notes_html]
        )
        with self._lock:
            self._ready = True
        self.render()
        if self.state.ended:  # it had ended (no "finished" event will come), or it just did
            self.close()
        if display:
            from IPython.display import display as show

            show(self.widget)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    # -- feeding ----------------------------------------------------------------------------
    def _snapshot(self) -> dict:
        if self._kept is not None:
            return self._kept
        return self.client.sync(self.client.scheduler.vcdask_panel, run_id=self.handle.run_id)

    def refresh(self) -> None:
        """Take a fresh snapshot of the run from the scheduler and redraw."""
        snap = self._snapshot()
        with self._lock:
            self.state.apply_snapshot(snap)
        self.render()

    def _on_event(self, event) -> None:
        _, msg = event
        with self._lock:
            self.state.apply(msg)
            if not self._ready:  # still being made: it draws (or lets go) once it is
                return
        if msg.get("type") in ("finished", "failed"):  # the run ended: draw its final state, then let go
            threading.Thread(target=self.close, daemon=True, name="vcdask-panel-close").start()
            return
        now = time.monotonic()
        if now - self._last_render >= _RENDER_INTERVAL:
            self.render()
        elif not self._render_pending:
            self._render_pending = True
            threading.Timer(_RENDER_INTERVAL, self.render).start()

    def update(self, status: dict) -> None:
        """Counters polled by a waiting ``fit``; the rest arrives as events."""
        with self._lock:
            self.state.apply_status(status)
        self.render()

    def close(self, status: dict | None = None) -> None:
        """Stop following events (other displays of the run go on); draw the run's final state."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._following is not None:
            self._following.close()
        try:
            self.refresh()
        except Exception:  # noqa: BLE001 - the scheduler may be gone; keep what the panel shows
            self.render()

    # -- drawing ----------------------------------------------------------------------------
    def render(self) -> None:
        with self._lock:
            self._render_pending = False
            self._last_render = time.monotonic()
            st = self.state
            status = st.status
            max_epochs = int(status.get("max_epochs") or 1)
            self.progress.max = max_epochs
            self.progress.value = st.epochs_done
            self.progress.bar_style = {"finished": "success", "error": "danger"}.get(str(status.get("status")), "info")
            self.progress_label.value = f"&nbsp;{st.epochs_done} / {max_epochs}"
            self.header.value = _header_html(st)
            self.grid_html.value = _grid_html(st)
            self.workers_html.value = _workers_html(st.worker_rows())
            self.notes_html.value = "".join(
                f"<div style='font-size:90%;color:#555'>{html.escape(n)}</div>" for n in st.notes
            )
            series = st.metric_series()
        if series["epoch"] != list(self.source.data["epoch"]):
            self.source.data = series


def _fmt(value, spec: str = ".4g") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "–"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return html.escape(str(value))


def _header_html(st: PanelState) -> str:
    s = st.status
    version = s.get("version") or ""
    last = st.epochs[max(st.epochs)] if st.epochs else {}
    metric = last.get(st.metric)
    parts = [
        f"<b>{html.escape(st.run_id)}</b> &middot; {html.escape(str(s.get('status', '')))}",
        f"version {s.get('step', 0)} <code>{html.escape(str(version)[:12])}</code>",
        (
            f"merge {html.escape(str(s.get('merge') or 'vc-asgd'))}"
            + (f" (alpha {_fmt(s.get('alpha'), '.3g')})" if s.get("alpha") is not None else "")
        ),
        f"staleness {_fmt(s.get('staleness'), 'd')}",
        f"{html.escape(st.metric)} {_fmt(metric)}",
        *_cost_html(s.get("cost"), list(st.workers.values())),
        f"store <code>{html.escape(str(s.get('store', '')))}</code>",
    ]
    out = " &nbsp;|&nbsp; ".join(parts)
    if st.paused:
        out += f"<div style='color:#b30000'><b>paused</b>: {html.escape(st.paused)}</div>"
    return f"<div style='font-family:sans-serif;font-size:95%'>{out}</div>"


def _cost_html(cost: dict | None, workers: list[dict] | None = None) -> list[str]:
    """Cost so far (with a price table, ``vcdask.cloud.prices``), and what on-demand would have cost; the
    workers left out of it said, not hidden in a total (none priced: no "$0.00")."""
    if not cost:
        return []
    workers = workers or []
    # (a row says its instance once the worker reported it, and its cost, NaN without a price, at the end)
    unpriced = sum(1 for w in workers if not w.get("instance") or w.get("cost", 0.0) != w.get("cost", 0.0))
    note = f" ({unpriced} worker{'s' if unpriced != 1 else ''} unpriced)" if unpriced else ""
    if unpriced and unpriced == len(workers):
        return [f"cost unknown{note}"]
    saving = cost.get("saving")
    tail = f" ({_fmt(100 * saving, '.0f')}% below on-demand)" if saving is not None and saving == saving else ""
    return [f"cost ${_fmt(cost.get('total'), '.2f')}{tail}{note}"]


def _grid_html(st: PanelState) -> str:
    rows = []
    size = "12px" if st.n_shards <= 64 else "6px"
    for epoch in st.grid_epochs():
        cells = "".join(
            f"<span title='shard {i}: {state}' style='display:inline-block;width:{size};"
            f"height:{size};margin:1px;background:{_COLORS.get(state, '#ccc')}'></span>"
            for i, state in enumerate(st.grid(epoch))
        )
        rows.append(
            f"<div style='white-space:nowrap'><span style='display:inline-block;width:58px;"
            f"font-size:85%'>epoch {epoch}</span>{cells}</div>"
        )
    counts: dict[str, int] = {}
    for epoch in st.grid_epochs():
        for state in st.grid(epoch):
            counts[state] = counts.get(state, 0) + 1
    legend = " ".join(
        f"<span style='font-size:80%'><span style='display:inline-block;width:9px;height:9px;"
        f"background:{c}'></span> {name} {counts.get(name, 0)}</span>"
        for name, c in SHARD_COLORS.items()
    )
    return f"<div style='font-family:sans-serif'><b>shards</b><br>{''.join(rows)}<div>{legend}</div></div>"


def _workers_html(rows: list[dict]) -> str:
    head = "".join(
        f"<th style='padding:1px 6px;text-align:right'>{h}</th>"
        for h in ("worker", "device", "state", "done", "failed", "timed out", "rejected", "mean s")
    )
    body = []
    for r in rows:
        color = {"active": "#3aa35b", "lost": "#d9534f", "excluded": "#d9534f", "preempted": "#f0a630"}[r["state"]]
        cells = [
            html.escape(str(r["worker"]).removeprefix("tcp://")),
            html.escape(str(r.get("device") or "–")),
            f"<span style='color:{color}'>{r['state']}</span>",
            r["done"],
            r["failed"],
            r["timed_out"],
            r["rejected"],
            _fmt(r.get("mean_seconds"), ".2f"),
        ]
        body.append("<tr>" + "".join(f"<td style='padding:1px 6px;text-align:right'>{c}</td>" for c in cells) + "</tr>")
    return (
        f"<div style='font-family:sans-serif;font-size:90%'><b>workers</b><table>"
        f"<tr>{head}</tr>{''.join(body)}</table></div>"
    )
