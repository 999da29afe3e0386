"""How a :class:`~vcdask.FitResult` shows itself in a notebook: an HTML summary and a bokeh plot."""

from __future__ import annotations

import html
import math

__all__ = ["fit_result_html", "fit_result_plot"]

_LOWER_IS_BETTER = ("loss", "mse", "mae")


def _fmt(value) -> str:
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.4g}"
    return html.escape(str(value))


def fit_result_html(result) -> str:
    """A compact HTML table: run id, final metrics, epochs, merges, versions, workers, store."""
    h = result.history
    merged = int(h["accepted"].sum()) if len(h) else 0
    not_merged = h[~h["accepted"]] if len(h) else h
    reasons: dict[str, int] = {}
    for reason in (not_merged["reason"] if len(not_merged) else []):
        kind = str(reason).split(":")[0]
        reasons[kind] = reasons.get(kind, 0) + 1
    rows = [("run", f"<code>{html.escape(result.run_id)}</code>"),
            ("final metrics", ", ".join(f"{html.escape(k)} <b>{_fmt(v)}</b>" for k, v in result.metrics.items())
             or "–"),
            ("epochs", f"{len(result.epochs)}" + (f" (stopped: {html.escape(result.stop_reason)})"
                                                   if result.stop_reason else "")),
            ("merges", f"{merged}" + (" &nbsp;(not merged: " + ", ".join(f"{k} {n}" for k, n in sorted(reasons.items()))
                                      + ")" if reasons else "")),
            ("final version", f"<code>{html.escape(str(result.version))}</code> (step {merged}) on branch "
                              f"<code>{html.escape(result.run_id)}</code>"),
            ("workers", f"{0 if result.workers is None else len(result.workers)}"),
            ("wall time", f"{_fmt(result.wall_time)} s"),
            ("store", f"<code>{html.escape(str(result.store.location))}</code>")]
    body = "".join(f"<tr><th style='text-align:left;padding:1px 8px'>{k}</th>"
                   f"<td style='text-align:left;padding:1px 8px'>{v}</td></tr>" for k, v in rows)
    return f"<div><b>vcdask.FitResult</b><table>{body}</table></div>"


def fit_result_plot(result):
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
    metrics = [c for c in names if not c.endswith(_LOWER_IS_BETTER)]
    losses = [c for c in names if c.endswith(_LOWER_IS_BETTER)] + ["train_loss"]
    figures = []
    for group, label in ((metrics, "validation metric"), (losses, "loss")):
        if not group:
            continue
        row = []
        for x, xlabel in (("wall_time", "wall time (s)"), ("epoch", "epoch")):
            fig = figure(height=260, width=420, x_axis_label=xlabel, y_axis_label=label, toolbar_location="right",
                         title=f"{label} vs {xlabel.split(' (')[0]}")
            for i, name in enumerate(group):
                color = Category10_10[i % 10]
                if f"{name}_min" in epochs.columns:
                    fig.varea(x=x, y1=f"{name}_min", y2=f"{name}_max", source=source, fill_alpha=0.2,
                              fill_color=color)
                fig.line(x=x, y=name, source=source, color=color, line_width=2, legend_label=name)
                fig.scatter(x=x, y=name, source=source, color=color, size=5)
            fig.legend.location = "bottom_right" if group is metrics else "top_right"
            row.append(fig)
        figures.append(row)
    return gridplot(figures)
