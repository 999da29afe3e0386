"""How a :class:`~vcdask.RunHandle` ends: the run's :class:`~vcdask.FitResult`, made of what its scheduler answered
when it ended (:func:`result_of`: the final parameters read from the store into the model, the history, the epochs,
the workers, the settings), and what the handle lets go of when it is closed or dropped (:class:`Owner`)."""

from __future__ import annotations

import copy
import pickle
import threading
from typing import Any

import torch

from .diagnose import annotate
from .engine.end import best_version
from .errors import RunCancelledError, RunFailedError
from .params import load_into
from .result import HISTORY_COLUMNS, FitResult, run_settings

__all__ = ["Owner", "result_of"]


def result_of(
    run_id: str, res: dict, model: torch.nn.Module | None, *, wall_time: float | None, setup_seconds: float, panel: Any
) -> FitResult:
    """The :class:`~vcdask.FitResult` of run ``run_id``, ended with ``res`` (its scheduler's ``vcdask_result``).

    Parameters
    ----------
    run_id : str
    res : dict
        What the run's scheduler answered: its status, final version, history, epochs, workers, cost ...
    model : torch.nn.Module, optional
        The module the final parameters are loaded into; default a copy of the run's model.
    wall_time : float, optional
        What ``FitResult.wall_time`` reports; default the run's own time plus ``setup_seconds``.
    setup_seconds : float
        From the ``fit`` call to the run's start (staging, the initial commit).
    panel : RunPanel or None
        The live panel the run was watched in, kept on the result.

    Raises
    ------
    RunCancelledError
        The run was cancelled.
    RunFailedError
        The run ended with an error.
    """
    if res["status"] == "cancelled":
        raise RunCancelledError(
            f"run {run_id} was cancelled ({res['stopping'] or 'its scheduler closed'}); its store "
            f"holds the version it reached: vcdask.load(store, branch={run_id!r}) (version {res['version']})"
        )
    if res["status"] != "finished":
        raise RunFailedError(f"run {run_id} ended with status {res['status']!r}:\n{res['error']}")
    import pandas as pd

    from .spec import load_spec

    store = pickle.loads(res["store"])
    spec = load_spec(store, run_id)
    if model is None:
        model = copy.deepcopy(spec.model)
    checkpoint = store.read(res["version"])
    load_into(model, checkpoint.params)
    # as vcdask.load marks a model (the same keys, vcdask's over the metadata's): a later fit of it records
    # this version as its start
    model.vcdask_version = {  # type: ignore[assignment]
        **checkpoint.metadata,
        "id": res["version"],
        "run_id": run_id,
        "tag": None,
        "store": store.location,
    }
    epochs = pd.DataFrame(res["epochs"])
    result = FitResult(
        model=model,
        history=pd.DataFrame(res["history"], columns=HISTORY_COLUMNS),
        epochs=epochs.set_index("epoch") if len(epochs) else epochs,
        run_id=run_id,
        store=store,
        version=res["version"],
        metrics=res.get("final_metrics") or {},
        workers=pd.DataFrame(res["workers"]),
        cost=res.get("cost") or {},
        stop_reason=res.get("stopping"),
        wall_time=setup_seconds + res["elapsed"] if wall_time is None else wall_time,
        panel=panel,
        best_version=best_version(store, res),
        start=res.get("start"),
        settings=run_settings(spec, res.get("merge")),
    )
    annotate(result)
    return result


#: Clients of live handles (by id): how many handles use each, and those a handle owns.  An owned client is
#: closed when the last handle using it lets go (``attach(run_id, handle.client)`` shares the client of a fit's
#: handle, which closed it under the second handle's feet when it was dropped).
_users: dict[int, int] = {}
_owned: set[int] = set()
_users_lock = threading.Lock()


class Owner:
    """What a :class:`RunHandle` lets go of when it is closed or dropped (its finalizer: it holds no reference
    to the handle): its hold of the run (``holder``, on the run's scheduler), whose result nobody will collect
    through it (``run_id``; None once it collected), and its use of the client, which it closes if a
    handle owned it (``owned``: the client ``fit`` opened for a cluster object or an address) and no other
    handle uses it."""

    def __init__(self, client: Any, run_id: str | None, owned: bool, holder: str | None = None) -> None:
        self.client, self.run_id, self.owned, self.holder = client, run_id, owned, holder
        with _users_lock:
            _users[id(client)] = _users.get(id(client), 0) + 1
            if owned:
                _owned.add(id(client))

    def let_go(self) -> None:
        """Called once (the handle's finalizer).  On the client's own event-loop thread (a reference cycle of
        the handle freed by a garbage collection there) its calls would only make coroutines nobody awaits: they
        go to a thread of their own."""
        if getattr(self.client, "asynchronous", False):
            threading.Thread(target=self._let_go, name="vcdask-handle-let-go", daemon=True).start()
        else:
            self._let_go()

    def _let_go(self) -> None:
        run_id, self.run_id = self.run_id, None
        try:
            if run_id is not None and self.holder is not None and getattr(self.client, "status", None) == "running":
                self.client.sync(
                    self.client.scheduler.vcdask_release, run_id=run_id, holder=self.holder, callback_timeout=10
                )
        except Exception:  # noqa: BLE001 - a scheduler gone: it keeps the run, as before
            pass
        finally:
            key = id(self.client)
            with _users_lock:
                _users[key] = _users.get(key, 1) - 1
                last = _users[key] <= 0
                if last:
                    del _users[key]
                close = last and key in _owned
                if close:
                    _owned.discard(key)
            if close:
                self.client.close()
