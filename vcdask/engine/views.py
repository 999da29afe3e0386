"""What clients see of a run: its status, the panel's snapshot, the final result (small dicts).

Functions of the run's core state (:class:`~vcdask.engine.core.RunState`), called by the plugin's handlers
on the event loop through the run's shell, which refreshes the state's server head first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cost import summarize

if TYPE_CHECKING:
    from .core import RunState

__all__ = ["panel_metric", "panel_state", "result_dict", "status_dict"]


def status_dict(run: RunState, stalled: str | None = None) -> dict[str, Any]:
    """Progress counters: status, step, epochs done, merged in the current epoch, last epoch's row,
    why the run is paused (``paused``, with ``paused_cause`` "workers" or "store"; ``stalled``: why the
    merge thread waits for the store, if it does) ..."""
    ledger, head = run.ledger, run.head
    store_paused = stalled or run.outage.why
    paused = store_paused or run.no_workers
    return {
        "run_id": run.id,
        "status": run.phase.value,
        "error": run.error,
        "step": head.step,
        "version": head.version or run.head_at_start,
        "epochs_done": len(ledger.epochs),
        "max_epochs": run.spec.max_epochs,
        "n_shards": run.spec.shards.n_shards,
        "merged_in_epoch": len(ledger.merged.get(len(ledger.epochs) + 1, ())),
        "in_flight": run.tasks.training(),
        "last_epoch": ledger.epochs[-1] if ledger.epochs else {},
        "stopping": run.stopping,
        "paused": paused,
        "paused_cause": None if paused is None else ("store" if store_paused else "workers"),
        "tasks": [{**row, "merged": ledger.is_merged(row["epoch"], row["shard"])} for row in run.tasks.table()],
        "elapsed": (run.ended or run.wall()) - run.started,
        "handed_over": run.handed_over,
        "alpha": _alpha_now(run),
        "staleness": ledger.last_staleness(),
        "store": run.spec.store.location,
        "branch": run.spec.branch,
        "merge": head.rule or getattr(run.spec.merge, "name", None),  # (what "auto" chose, once it has)
        "cost": _cost_so_far(run),
    }


def _cost_so_far(run: RunState) -> dict[str, float] | None:
    """What the workers cost so far, and the saving against on-demand (None without a price table)."""
    if not run.spec.prices:
        return None
    cost = summarize(run.pool.rows(), run.spec.prices, _merges(run))
    return {"total": cost["total"], "on_demand": cost["on_demand"], "saving": cost["saving"]}


def _merges(run: RunState) -> int:
    """The merges since the run started or was resumed: what its workers' time (``run.pool``, which a
    resumed run starts afresh) paid for.  Not ``head.step``, which counts the merges of every session."""
    return sum(1 for row in run.ledger.history if row["accepted"])


def _alpha_now(run: RunState) -> float | None:
    """The weight the newest merge kept of ``W_s`` (the paper's alpha; None for a rule without one), as the
    panel's update events show it: fit's default rule may have moved on from the spec's as the fleet grew
    (:mod:`vcdask.engine.following`).  Before the first merge, the spec's rule's alpha for the epoch."""
    last = run.ledger.last_merged()
    if last is not None:
        return last.get("alpha")
    try:
        schedule = getattr(run.spec.merge, "schedule", None)
        return None if schedule is None else float(schedule(max(1, run.dispatch.epoch)))
    except Exception:  # noqa: BLE001 - a user's schedule; the panel shows nothing rather than fail
        return None


def panel_state(run: RunState, stalled: str | None = None, recent_epochs: int = 50) -> dict[str, Any]:
    """Everything the progress panel shows, for a panel that starts (or re-attaches) mid-run;
    events keep it current from there."""
    first = max(1, run.dispatch.epoch - recent_epochs + 1)
    return {
        "status": status_dict(run, stalled),
        "epochs": list(run.ledger.epochs),
        "workers": run.pool.rows(),
        "shards": [[e, s, st] for (e, s), st in run.ledger.shard_state.items() if e >= first],
        "metric": panel_metric(run.spec),
    }


def panel_metric(spec: Any) -> str:
    """The metric the panel plots for the run of ``spec``: its first validation metric, or the training
    loss of a run without validation data."""
    metrics = list(spec.metric_names or spec.metrics) or ["loss"]
    return metrics[0] if spec.validation is not None else "train_loss"


def result_dict(run: RunState, stalled: str | None = None) -> dict[str, Any]:
    """The status plus everything a :class:`~vcdask.FitResult` is made of (kept as it was when the run
    ended: :attr:`Run.final`)."""
    if run.final is not None:
        return run.final
    ledger = run.ledger
    workers = run.pool.rows()
    return {
        **status_dict(run, stalled),
        "history": ledger.history,
        "epochs": ledger.epochs,
        "workers": workers,
        "cost": summarize(workers, run.spec.prices or {}, _merges(run)),
        "final_metrics": ledger.validations.get(run.head.version_step),
        "branch": run.spec.branch,
        "best": ledger.best,  # {"epoch", "step", "value"} of the monitored metric's best epoch, or None
        "monitor": run.spec.monitor,
        "start": run.spec.start,
    }
