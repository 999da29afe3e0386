"""What clients see of a run: its status, the panel's snapshot, the final result (small dicts).

Functions of the :class:`~vcdask.engine.run.Run`, called by the plugin's handlers on the event loop.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..cost import summarize

if TYPE_CHECKING:
    from .run import Run

__all__ = ["panel_state", "result_dict", "status_dict"]


def status_dict(run: Run) -> dict[str, Any]:
    """Progress counters: status, step, epochs done, merged in the current epoch, last epoch's row,
    why the run is paused (``paused``, with ``paused_cause`` "workers" or "store") ..."""
    ledger, server = run.ledger, run.server
    store_paused = server.stalled() or run.outage.why
    paused = store_paused or run.no_workers
    return {
        "run_id": run.id,
        "status": run.status,
        "error": run.error,
        "step": server.step,
        "version": server.version or run.head_at_start,
        "epochs_done": len(ledger.epochs),
        "max_epochs": run.spec.max_epochs,
        "n_shards": run.spec.shards.n_shards,
        "merged_in_epoch": len(ledger.merged.get(len(ledger.epochs) + 1, ())),
        "in_flight": run.tasks.training(),
        "last_epoch": ledger.epochs[-1] if ledger.epochs else {},
        "stopping": run.stopping,
        "paused": paused,
        "paused_cause": None if paused is None else ("store" if store_paused else "workers"),
        "tasks": run.tasks.table(),
        "elapsed": (run.ended or time.time()) - run.started,
        "alpha": _alpha_now(run),
        "staleness": ledger.last_staleness(),
        "store": run.store.location,
        "branch": run.spec.branch,
        "merge": getattr(run.spec.merge, "name", None),
        "cost": _cost_so_far(run),
    }


def _cost_so_far(run: Run) -> dict[str, float] | None:
    """What the workers cost so far, and the saving against on-demand (None without a price table)."""
    if not run.spec.prices:
        return None
    cost = summarize(run.pool.rows(), run.spec.prices, run.server.step)
    return {"total": cost["total"], "on_demand": cost["on_demand"], "saving": cost["saving"]}


def _alpha_now(run: Run) -> float | None:
    try:
        schedule = getattr(run.spec.merge, "schedule", None)
        return None if schedule is None else float(schedule(max(1, run.dispatch.epoch)))
    except Exception:  # noqa: BLE001 - a user's schedule; the panel shows nothing rather than fail
        return None


def panel_state(run: Run, recent_epochs: int = 50) -> dict[str, Any]:
    """Everything the progress panel shows, for a panel that starts (or re-attaches) mid-run;
    events keep it current from there."""
    first = max(1, run.dispatch.epoch - recent_epochs + 1)
    metrics = list(run.spec.metric_names or run.spec.metrics) or ["loss"]
    return {
        "status": status_dict(run),
        "epochs": list(run.ledger.epochs),
        "workers": run.pool.rows(),
        "shards": [[e, s, st] for (e, s), st in run.ledger.shard_state.items() if e >= first],
        "metric": metrics[0] if run.spec.validation is not None else "train_loss",
    }


def result_dict(run: Run) -> dict[str, Any]:
    """The status plus everything a :class:`~vcdask.FitResult` is made of (kept as it was when the run
    ended: :attr:`Run.final`)."""
    if run.final is not None:
        return run.final
    ledger = run.ledger
    workers = run.pool.rows()
    return {
        **status_dict(run),
        "history": ledger.history,
        "epochs": ledger.epochs,
        "workers": workers,
        "cost": summarize(workers, run.spec.prices or {}, run.server.step),
        "final_metrics": ledger.validations.get(run.server.version_step),
        "branch": run.spec.branch,
        "best": ledger.best,  # {"epoch", "step", "value"} of the monitored metric's best epoch, or None
        "monitor": run.spec.monitor,
        "start": run.spec.start,
    }
