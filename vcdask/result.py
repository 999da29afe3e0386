"""What a run returns: :class:`FitResult`, with an HTML summary and a bokeh plot for notebooks."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .engine.policy import lower_is_better

__all__ = ["HISTORY_COLUMNS", "FitResult", "run_settings", "trained_with"]

#: The columns of ``FitResult.history`` (one row per shard-task outcome).
HISTORY_COLUMNS = [
    "epoch",
    "shard",
    "attempt",
    "worker",
    "device",
    "base_version",
    "new_version",
    "version_id",
    "alpha",
    "staleness",
    "train_loss",
    "first_loss",
    "seconds",
    "read_seconds",
    "wait_seconds",
    "train_seconds",
    "upload_seconds",
    "nbytes",
    "fraction",
    "steps_ahead",
    "accepted",
    "outcome",
    "reason",
    "time",
    "update",
]


@dataclass
class FitResult:
    """What :func:`vcdask.fit` (and :meth:`RunHandle.result`) returns.

    Attributes
    ----------
    model : torch.nn.Module
        The model, holding the final server parameters.
    history : pandas.DataFrame
        One row per update: epoch, shard, attempt, worker, device (where it trained), base_version, new_version,
        version_id (empty for a merge committed together with later ones, with ``commit_every`` other than 1),
        alpha, staleness, train_loss, first_loss (of the task's first local step, before it had
        trained: at its base), seconds (of the task: read_seconds for the
        version and rows, of which wait_seconds waiting for the merges before its base (or, for a base the
        answer to its worker's last hand-over brought, that hand-over's wait, before this task began), train_seconds,
        upload_seconds), nbytes (the update as sent), fraction (the share of its
        shard's batches the task trained: below 1 on a slow worker with ``speed_adaptive``), steps_ahead (local steps it
        trained from its worker's own last update before the merged version came, with
        ``vcdask.worker.overlap="delta"``; see :mod:`vcdask.overlap`), accepted, outcome (one of
        :data:`vcdask.engine.events.OUTCOMES`: merged, rejected, duplicate, late, lost, failed (the task
        raised, under ``on_shard_failure="skip"``), cancelled, skipped, store fault), reason (why, in
        words, for an update not merged), time (since the run started), update (path of W_c under
        ``<store>/runs``).
    epochs : pandas.DataFrame
        One row per epoch: validation metrics of the epoch's last version, their mean, min
        and max over the epoch's validated versions, train loss, shards skipped, wall time.
    workers : pandas.DataFrame
        One row per worker: its device, shards done, failed, timed out, rejected, mean shard seconds,
        preempted, why it was excluded (if it was); for cost accounting its ``instance`` type and
        ``market``, seconds ``alive`` (connected), ``busy`` and ``wasted`` (work lost to a preemption
        or to its death), and its ``cost``.
    cost : dict
        What the run's workers cost (:mod:`vcdask.cost`, prices from ``vcdask.cloud.prices``):
        ``total`` and ``on_demand`` ($), ``saving`` (share), ``per_merge``, ``wasted_seconds``, and the
        workers whose instance type has no price (``unpriced``).
    run_id : str
    store : ParamStore
    version : str
        The final version id (on branch ``run_id``).
    metrics : dict
        Validation metrics of the final version (empty without validation data).
    panel : vcdask.panel.RunPanel or None
        The live panel shown while the run trained (in a Jupyter kernel; None elsewhere, and in a pickled or
        copied result: the panel holds the kernel's client and threads).
    best_version : str or None
        With validation: the version that ended the best epoch of the monitored metric (``monitor=``,
        default the ``target``'s metric or the first metric); ``model`` and ``version`` hold the last
        one.  Load the best with ``vcdask.load(result.store, version=result.best_version)``.
    start : dict or None
        Where the run's initial parameters came from: ``{"version", "tag", "store"}`` for a model
        from :func:`vcdask.load`, None for a fresh model.
    notes : list of str
        What the run's numbers say beyond its metrics: the shards it gave up (``on_shard_failure="skip"``,
        :func:`vcdask.diagnose.given_up`), that nothing was validated (no validation data), that the
        training diverged (:func:`vcdask.diagnose.divergence`, also warned).
    settings : dict
        How the run trained, with what ``fit`` decided where it was left to it (:func:`run_settings`):
        ``merge`` (the rule that merged last, as the panel names it: what ``merge="auto"`` chose, such as
        ``"auto: probe, 16 rows"``, or the rule fit's default moved to as the fleet grew),
        ``optimizer_state`` (``"fresh"`` or ``"worker"``: what ``"auto"`` decided), ``n_shards``,
        ``local_steps`` (optimizer steps a task takes on the smallest shard) and ``overlap``.
    """

    model: torch.nn.Module
    history: Any
    epochs: Any
    run_id: str
    store: Any
    version: str
    metrics: dict[str, float] = field(default_factory=dict)
    workers: Any = None
    cost: dict[str, Any] = field(default_factory=dict)
    stop_reason: str | None = None
    wall_time: float = float("nan")
    panel: Any = field(default=None, repr=False)
    best_version: str | None = None
    start: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    def predict(self, X: Any, *, batch_size: int = 1024, device: Any = None) -> np.ndarray:
        """Predictions of the trained model for the rows of ``X``.

        The rows go through :attr:`model` in batches of ``batch_size``, without gradients and in eval mode
        (the model's mode is restored after).  A DataFrame's feature columns, or an xarray Dataset's
        feature variables, are picked by the names the run trained on (``features=``, or the variables an
        xarray / Zarr run inferred), as float32.

        Parameters
        ----------
        X : numpy array, torch tensor, pandas DataFrame or xarray Dataset
            The rows, sample axis first, each shaped as the training samples.
        batch_size : int, default 1024
        device : {"auto", "cpu", "cuda", "cuda:N", "mps"} or torch.device, optional
            Where to run the model (on a copy), as ``fit``'s ``device=`` in this process (``"auto"``: its
            accelerator if it has one); default where :attr:`model` is (the CPU, unless you moved it).

        Returns
        -------
        numpy.ndarray
            For a classifier (a run on integer labels): the class ids (int64) in the labels' shape, the arg-max
            of the outputs along their class axis: the last of ``(n, C)`` outputs (shape (n,)), axis 1 of a
            classifier per position's ``(n, C, T)`` (shape (n, T)), as ``cross_entropy`` reads them.  For one
            logit per label (float 0/1 labels trained with ``binary_cross_entropy_with_logits``): the class ids
            (int64, 1 where the logit is above 0) in the labels' shape.  Otherwise the model's outputs, shape
            (n, ...) as the model gives them (bfloat16 ones as float32: numpy has no bfloat16).

        Raises
        ------
        DataError
            The model cannot take the rows, or a DataFrame or Dataset lacks a feature the run trained on.
        TypeError
            An unsupported input, a run with dict batches (a custom ``train_step``), or a ``train_step``'s run on
            integer labels whose outputs are not scores per class for them (a count regression): call :attr:`model`.
        ValueError
            ``device`` names no kind of device; ``RuntimeError``: one this process does not have.

        Examples
        --------
        >>> result = vcdask.fit(model, df, label="target")  # doctest: +SKIP
        >>> result.predict(df_new)  # doctest: +SKIP
        array([0, 2, 1, ...])
        """
        from .predict import model_outputs, predicted

        spec = self._spec()
        return predicted(model_outputs(self.model, spec, X, batch_size=batch_size, device=device), spec)

    def predict_proba(self, X: Any, *, batch_size: int = 1024, device: Any = None) -> np.ndarray:
        """Class probabilities of a classifier for the rows of ``X``: the softmax of its outputs, or the sigmoid
        of one logit per label.

        Takes the same inputs as :meth:`predict`; ``predict(X)`` is the arg-max of these.

        Returns
        -------
        numpy.ndarray
            Shape (n, n_classes), rows summing to 1 (a classifier per position: (n, n_classes, T), summing to 1
            along axis 1).  One logit per sample (``binary_cross_entropy_with_logits``): shape (n, 2), the
            probabilities of class 0 and class 1; several logits per sample: the sigmoid of each.

        Raises
        ------
        TypeError
            The run is a regression (its labels were floats, its loss not ``binary_cross_entropy_with_logits``):
            use :meth:`predict`; or a ``train_step``'s run on integer labels whose outputs are not scores per class.
        """
        from .predict import binary_classifier, model_outputs, probabilities

        spec = self._spec()
        if not spec.classification and not binary_classifier(spec):
            raise TypeError(
                f"predict_proba is for classifiers (runs on integer class ids, or one logit per label trained with "
                f"binary_cross_entropy_with_logits), but run {self.run_id} trained a regression on float labels; "
                "use predict(X) for its outputs"
            )
        return probabilities(model_outputs(self.model, spec, X, batch_size=batch_size, device=device), spec)

    def __getstate__(self) -> dict[str, Any]:
        """What pickles (``pickle``, ``copy.deepcopy``, ``joblib.dump``): everything but the live :attr:`panel`,
        which holds the notebook's client and threads (a copy has None)."""
        return {**self.__dict__, "panel": None}

    def _spec(self):
        """The run's :class:`~vcdask.spec.RunSpec` (read from the store once per process)."""
        from .spec import load_spec

        return load_spec(self.store, self.run_id)

    def _repr_html_(self) -> str:
        return _html(self)

    def plot(self, show: bool = True):
        """Validation metrics and loss against wall time and against epoch (bokeh).

        Parameters
        ----------
        show : bool, default True
            Show the plot now: in a Jupyter kernel, below the cell; in a script, as an HTML page in a
            temporary file, opened in the web browser (its path is printed), as ``bokeh.io.show`` does.
            False: return it.

        Returns
        -------
        bokeh.models.GridPlot or None
            The plot, when it is not shown (save it with ``bokeh.io.save``); None once shown.
        """
        layout = _plot(self)
        if not show:
            return layout
        from .panel import in_kernel

        if not in_kernel():
            _show_in_browser(layout, f"vcdask run {self.run_id}")
            return None
        from IPython.display import display
        from jupyter_bokeh import BokehModel

        from .panel import load_bokehjs

        load_bokehjs()
        display(BokehModel(layout))
        return None

    def __repr__(self) -> str:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in self.metrics.items())
        notes = "".join(f"; {note.split(':')[0]}" for note in self.notes)
        return (
            f"<FitResult {self.run_id}: {len(self.epochs)} epochs, {int(self.history['accepted'].sum())} "
            f"merges, version {self.version}{', ' + metrics if metrics else ''}{notes}>"
        )


def _show_in_browser(layout: Any, title: str) -> None:
    """Write ``layout`` to a self-contained HTML file (bokeh's scripts inline: no network) and open it."""
    import sys
    import tempfile
    import webbrowser
    from pathlib import Path

    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    with tempfile.NamedTemporaryFile("w", suffix=".html", prefix="vcdask-plot-", delete=False) as f:
        f.write(file_html(layout, INLINE, title))
    path = Path(f.name)
    print(f"vcdask: the plot is in {path}", file=sys.stderr)
    webbrowser.open(path.as_uri())


def _fmt(value) -> str:
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.4g}"
    return html.escape(str(value))


def run_settings(spec: Any, merge: str | None = None) -> dict[str, Any]:
    """:attr:`FitResult.settings` of the run of ``spec`` (its :class:`~vcdask.spec.RunSpec`), whose rule
    is named ``merge`` now (the run's status; default: the spec's rule)."""
    return {
        "merge": merge or getattr(spec.merge, "name", type(spec.merge).__name__),
        "optimizer_state": spec.optimizer_state,
        "n_shards": spec.shards.n_shards,
        "local_steps": spec.shards.local_steps(spec.batch_size, spec.local_epochs),
        "overlap": spec.overlap,
    }


_OPTIMIZER_STATES = {"worker": "inner optimizer kept per worker", "fresh": "a fresh inner optimizer per task"}


def trained_with(settings: dict[str, Any]) -> str:
    """:attr:`FitResult.settings` in words, one line: ``"merge auto: probe, 16 rows; inner optimizer kept per
    worker; 8 shards of 16 local steps"``."""
    return (
        f"merge {settings['merge']}; {_OPTIMIZER_STATES[settings['optimizer_state']]}; "
        f"{settings['n_shards']} shards of {settings['local_steps']} local steps"
    )


def _step(result: FitResult, merged: int) -> int:
    """The final version's step: the merges of the whole run (a resumed run's history has only its own)."""
    return int((getattr(result.model, "vcdask_version", None) or {}).get("step", merged))


def _html(result: FitResult) -> str:
    """A compact HTML table: run id, final metrics, epochs, merges, versions, workers, store."""
    h = result.history
    merged = int(h["accepted"].sum()) if len(h) else 0
    not_merged = h[~h["accepted"]] if len(h) else h
    reasons: dict[str, int] = {}
    for outcome in not_merged["outcome"] if len(not_merged) else []:
        reasons[str(outcome)] = reasons.get(str(outcome), 0) + 1
    rows = [
        ("run", f"<code>{html.escape(result.run_id)}</code>"),
        ("final metrics", ", ".join(f"{html.escape(k)} <b>{_fmt(v)}</b>" for k, v in result.metrics.items()) or "–"),
        (
            "epochs",
            f"{len(result.epochs)}" + (f" (stopped: {html.escape(result.stop_reason)})" if result.stop_reason else ""),
        ),
        (
            "merges",
            f"{merged}"
            + (
                " &nbsp;(not merged: " + ", ".join(f"{k} {n}" for k, n in sorted(reasons.items())) + ")"
                if reasons
                else ""
            ),
        ),
        (
            "final version",
            f"<code>{html.escape(str(result.version))}</code> (step {_step(result, merged)}) on branch "
            f"<code>{html.escape(result.run_id)}</code>",
        ),
        *((("trained with", html.escape(trained_with(result.settings))),) if result.settings else ()),
        ("workers", f"{0 if result.workers is None else len(result.workers)}"),
        ("wall time", f"{_fmt(result.wall_time)} s"),
        ("store", f"<code>{html.escape(str(result.store.location))}</code>"),
        *(("note", f"<span style='color:#a94442'>{html.escape(note)}</span>") for note in result.notes),
    ]
    body = "".join(
        f"<tr><th style='text-align:left;padding:1px 8px'>{k}</th>"
        f"<td style='text-align:left;padding:1px 8px'>{v}</td></tr>"
        for k, v in rows
    )
    return f"<div><b>vcdask.FitResult</b><table>{body}</table></div>"


def _plot(result: FitResult):
    """A 2x2 bokeh grid: validation metric(s) and loss, against wall time and against epoch,
    with the per-epoch min/max band of the validation metrics."""
    from bokeh.layouts import gridplot
    from bokeh.models import ColumnDataSource
    from bokeh.palettes import Category10_10
    from bokeh.plotting import figure

    epochs = result.epochs.reset_index() if len(result.epochs) else result.epochs
    if not len(epochs):
        raise ValueError(f"run {result.run_id} finished no epoch: there is nothing to plot")
    source = ColumnDataSource({c: epochs[c].to_numpy() for c in epochs.columns})
    names = [c for c in epochs.columns if f"{c}_min" in epochs.columns]
    metrics = [c for c in names if not lower_is_better(c)]
    losses = [c for c in names if lower_is_better(c)] + ["train_loss"]
    figures = []
    for group, label in ((metrics, "validation metric"), (losses, "loss")):
        if not group:
            continue
        row = []
        for x, xlabel in (("wall_time", "wall time (s)"), ("epoch", "epoch")):
            fig = figure(
                height=260,
                width=420,
                x_axis_label=xlabel,
                y_axis_label=label,
                toolbar_location="right",
                title=f"{label} vs {xlabel.split(' (')[0]}",
            )
            for i, name in enumerate(group):
                color = Category10_10[i % 10]
                if f"{name}_min" in epochs.columns:
                    fig.varea(x=x, y1=f"{name}_min", y2=f"{name}_max", source=source, fill_alpha=0.2, fill_color=color)
                fig.line(x=x, y=name, source=source, color=color, line_width=2, legend_label=name)
                fig.scatter(x=x, y=name, source=source, color=color, size=5)
            fig.legend.location = "bottom_right" if group is metrics else "top_right"
            row.append(fig)
        figures.append(row)
    return gridplot(figures)  # type: ignore[arg-type]
