"""Handles on runs that live on a scheduler: watch, wait, stop, and collect a :class:`FitResult`.

A run outlives the process that started it; :func:`attach` gives any process that can
reach the scheduler the same handle ``fit`` uses.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from .engine.plugin import PLUGIN_NAME, VcdaskPlugin
from .errors import RunFailedError, RunNotFoundError
from .params import load_into
from .result import HISTORY_COLUMNS, FitResult

__all__ = ["FitResult", "RunFailedError", "RunHandle", "attach", "ensure_plugin"]

_ENDED = ("finished", "error", "cancelled")


def ensure_plugin(client) -> None:
    """Register the vcdask scheduler plugin unless the scheduler already has it."""
    if not client.run_on_scheduler(_has_plugin):
        client.register_plugin(VcdaskPlugin(), name=PLUGIN_NAME)


def _has_plugin(dask_scheduler=None) -> bool:
    return PLUGIN_NAME in dask_scheduler.plugins


class RunHandle:
    """A run on a scheduler, seen from a client.

    Parameters
    ----------
    run_id : str
    client : distributed.Client
    """

    def __init__(self, run_id: str, client):
        self.run_id = run_id
        self.client = client
        self.display = None  # the progress display of the last wait()

    def __repr__(self) -> str:
        return f"<RunHandle {self.run_id} on {self.client.scheduler.address}>"

    def status(self) -> dict:
        """Progress counters: status, step, epochs done, merged in the current epoch, last epoch's metrics."""
        return self.client.sync(self.client.scheduler.vcdask_status, run_id=self.run_id)

    def panel(self):
        """Display the live progress panel of this run in a notebook (also after re-attaching to a
        running run); it follows the run's events until the run ends.

        Returns
        -------
        vcdask.panel.RunPanel
        """
        from .panel import RunPanel

        return RunPanel(self)

    def stop(self, reason: str = "stopped by the user") -> dict:
        """Stop dispatching; the run commits what it merged and finishes."""
        return self.client.sync(self.client.scheduler.vcdask_stop, run_id=self.run_id, reason=reason)

    def wait(self, timeout: float | None = None, progress: bool = False) -> dict:
        """Block until the run ends (or ``timeout`` seconds pass); Ctrl-C stops the run.

        Returns
        -------
        dict
            The last status.
        """
        import time

        from .progress import make_progress

        bar = make_progress(self, enabled=progress)
        if progress:
            self.display = bar
        status = None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                status = self.client.sync(self.client.scheduler.vcdask_wait, run_id=self.run_id, timeout=0.5)
                bar.update(status)
                if status["status"] in _ENDED or (deadline is not None and time.monotonic() > deadline):
                    return status
        except KeyboardInterrupt:
            self.stop("interrupted")
            raise
        finally:
            bar.close(status)

    def result(self, model: torch.nn.Module | None = None, wall_time: float = float("nan")) -> FitResult:
        """Wait for the run and return its :class:`FitResult`.

        Parameters
        ----------
        model : torch.nn.Module, optional
            Module to load the final parameters into; default a copy of the run's model.

        Raises
        ------
        RunFailedError
            The run ended with an error or was cancelled.
        """
        import pandas as pd

        from .spec import load_spec

        self.wait()
        res = self.client.sync(self.client.scheduler.vcdask_result, run_id=self.run_id)
        if res["status"] != "finished":
            raise RunFailedError(f"run {self.run_id} ended with status {res['status']!r}:\n{res['error']}")
        store = pickle.loads(res["store"])
        if model is None:
            import copy

            model = copy.deepcopy(load_spec(store, self.run_id).model)
        load_into(model, store.read(res["version"]).params)
        epochs = pd.DataFrame(res["epochs"])
        return FitResult(
            model=model,
            history=pd.DataFrame(res["history"], columns=HISTORY_COLUMNS),
            epochs=epochs.set_index("epoch") if len(epochs) else epochs,
            run_id=self.run_id,
            store=store,
            version=res["version"],
            metrics=res.get("final_metrics") or {},
            workers=pd.DataFrame(res["workers"]),
            cost=res.get("cost") or {},
            stop_reason=res.get("stopping"),
            wall_time=wall_time,
            panel=self.display if type(self.display).__name__ == "RunPanel" else None,
        )


def attach(run_id: str, client: Any = None) -> RunHandle:
    """A handle on a run that lives on a scheduler, from any process that can reach it.

    Parameters
    ----------
    run_id : str
        The run's id (``FitResult.run_id``, or the progress bar's label).
    client : distributed.Client or str, optional
        A client, or a scheduler address; default: the current default client.

    Raises
    ------
    RunNotFoundError
        The scheduler has no such run (the message lists those it has).
    """
    from distributed import Client, default_client

    if client is None:
        client = default_client()
    elif isinstance(client, str):
        client = Client(client, set_as_default=False)
    if not client.run_on_scheduler(_has_plugin):
        raise RunNotFoundError(
            f"no vcdask run {run_id!r}: the scheduler at {client.scheduler.address} has never run vcdask"
        )
    runs = client.sync(client.scheduler.vcdask_runs)
    if run_id not in runs:
        raise RunNotFoundError(f"no vcdask run {run_id!r} on {client.scheduler.address}; runs: {sorted(runs)}")
    return RunHandle(run_id, client)
