"""Handles on runs that live on a scheduler: watch, wait, stop, and collect a :class:`FitResult`.

A run outlives the process that started it; :func:`vcdask.attach` (:mod:`vcdask.reach`) gives any process
that can reach the scheduler the same handle ``fit`` uses.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

import torch

from ._collect import Owner, result_of
from ._ints import is_real
from ._packages import check_scheduler_error
from .cluster import check_sync, is_embedded
from .engine.plugin import PLUGIN_NAME, VcdaskPlugin
from .errors import RunCancelledError, RunFailedError
from .result import FitResult

__all__ = ["FitResult", "RunCancelledError", "RunFailedError", "RunHandle", "ensure_plugin"]

_ENDED = ("finished", "error", "cancelled")


def ensure_plugin(client) -> None:
    """Register the vcdask scheduler plugin unless the scheduler already has it; a scheduler that cannot import
    vcdask raises :class:`~vcdask.errors.ClusterPackageError`, naming it and what to install there."""
    try:
        if not client.run_on_scheduler(_has_plugin):
            client.register_plugin(VcdaskPlugin(), name=PLUGIN_NAME)
    except ImportError as e:
        check_scheduler_error(client, e)
        raise


def _has_plugin(dask_scheduler=None) -> bool:
    return PLUGIN_NAME in dask_scheduler.plugins


class RunHandle:
    """A run on a scheduler, seen from a client; it behaves like a future of the run's :class:`FitResult`.

    :func:`vcdask.fit` with ``wait=False`` returns one as soon as the run has started;
    :func:`attach` gives one from any process that reaches the scheduler.  Like
    :class:`concurrent.futures.Future` and :class:`distributed.Future`: :meth:`done`,
    :meth:`result`, :meth:`cancel`, :meth:`cancelled`, :meth:`add_done_callback`, and ``await handle``
    in async code (with an asynchronous Client, the other methods are called in a thread:
    ``await asyncio.to_thread(handle.status)``; from its event loop they raise ``TypeError``).

    Parameters
    ----------
    run_id : str
    client : distributed.Client
    model : torch.nn.Module, optional
        The module :meth:`result` loads the final parameters into (``fit`` passes the caller's).
    owns_client : bool, default False
        The handle closes ``client`` once the run's result is collected (or it is cancelled), on
        :meth:`close`, or at the end of a ``with`` block: ``fit(client=<cluster or address>,
        wait=False)`` opens a client of its own for the run and hands it over this way.
    holder : str, optional
        The id this handle holds the run's session by on its scheduler (``fit``, ``resume`` and ``attach``
        register one): closed or dropped, the handle lets go, and a run none holds may be dropped once it ended.

    Examples
    --------
    >>> handle = vcdask.fit(model, (X, y), wait=False)   # doctest: +SKIP
    >>> handle.status()["epochs_done"]                     # doctest: +SKIP
    >>> result = handle.result(timeout=600)                # doctest: +SKIP
    >>> with vcdask.fit(model, (X, y), client=cluster, wait=False) as handle:  # doctest: +SKIP
    ...     result = handle.result()                       # the handle's own client is closed after
    """

    def __init__(
        self,
        run_id: str,
        client,
        model: torch.nn.Module | None = None,
        *,
        setup_seconds: float = 0.0,
        owns_client: bool = False,
        holder: str | None = None,
    ):
        self.run_id = run_id
        self.client = client
        self.display = None  # the progress display of the last wait()
        self._model = model
        self._setup_seconds = setup_seconds  # from the fit call to the run's start (staging, initial commit)
        self._closed = False
        self._address = getattr(getattr(client, "scheduler", None), "address", None)  # (kept: the client may close)
        self._embedded = is_embedded(client)  # (closed by close_embedded() or at exit, the run ends with it)
        self._lock = threading.Lock()  # one collection at a time (await handle + a done callback ...)
        self._result: FitResult | None = None
        self._res: dict | None = None  # the run's result dict, once it ended (then no client is needed)
        # a handle dropped without close() (fit(client=cluster, wait=False) in a loop) closes the client it owns
        # when it is collected: the client's own periodic callbacks keep it alive, connected, for good; and it
        # lets go of its hold of the run (a run none holds is dropped once it ended, as a result no future holds)
        self._owner = Owner(client, run_id, owns_client, holder)
        self._finalizer = weakref.finalize(self, self._owner.let_go)
        self._finalizer.atexit = False  # (at exit there is nothing to let go of: the process and its clients go)

    def __repr__(self) -> str:
        where = "closed" if self._closed or self._client_gone() else f"on {self._address}"
        return f"<RunHandle {self.run_id} {where}>"

    def __enter__(self) -> RunHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client this handle owns (see ``owns_client``; a client you passed stays open, and so does
        one another handle still uses: ``attach(run_id, handle.client)``).  The run goes on on its scheduler:
        :func:`attach` gives a new handle.  The handle lets go of its hold of the run: a run no handle holds any
        more (and one whose result a handle collected) is dropped once it ended, among the oldest beyond
        ``vcdask.scheduler.ended-runs-kept``."""
        if self._owner.owned:
            self._closed = True
        self._finalizer()

    def _client_gone(self) -> bool:
        """Whether the handle's client was closed (by you, or by ``close_embedded()``), not by :meth:`close`."""
        return getattr(self.client, "status", None) in ("closing", "closed") or self.client.scheduler is None

    def _check_open(self) -> None:
        """Refuse to ask the scheduler through a client that was closed, or that is asynchronous here."""
        self._check_closed()
        check_sync(
            self.client,
            "await handle (the result), or call the handle's methods in a thread: "
            "await asyncio.to_thread(handle.status); or attach with a synchronous Client",
        )

    def _check_closed(self) -> None:
        error = self._closed_error()
        if error is not None:
            raise error

    def _closed_error(self) -> RuntimeError | None:
        """What a call through a closed client says, and how to reach the run again (None while it is open)."""
        if self._closed:
            return RuntimeError(
                f"this handle of run {self.run_id} is closed (its client was closed); "
                "vcdask.attach(run_id, client) gives a new one"
            )
        if self._client_gone() and self._embedded:
            return RuntimeError(
                f"the embedded cluster of run {self.run_id} was closed (vcdask.cluster.close_embedded(), or the "
                f"interpreter's exit) and the run ended with it, where it was: vcdask.resume({self.run_id!r}, "
                "store=<its store>) continues it"
            )
        if self._client_gone():
            return RuntimeError(
                f"the client of this handle of run {self.run_id} was closed; the run goes on on its scheduler: "
                f"vcdask.attach({self.run_id!r}, {self._address!r}) gives a new handle"
            )
        return None

    def _ask(self, handler: str, **kwargs: Any) -> Any:
        """The answer of the run's scheduler to ``handler`` (``vcdask_status``, ``vcdask_wait`` ...) for this run.

        A client closed while the call waits (a thread in :meth:`wait` or :meth:`result` when the
        ``with Client(...)`` block ends, or ``close_embedded()``) raises what a call after it would
        (:meth:`_check_open`), not what the closing left in the call (a bare ``CommClosedError``)."""
        self._check_open()
        try:
            return self.client.sync(getattr(self.client.scheduler, handler), run_id=self.run_id, **kwargs)
        except (Exception, asyncio.CancelledError):
            error = self._closed_error()
            if error is None:
                raise
            raise error from None

    def __await__(self):
        """``await handle``: the :class:`FitResult`, waited for in a thread (the event loop stays free)."""
        return asyncio.get_running_loop().run_in_executor(None, self.result).__await__()

    def status(self) -> dict:
        """Progress counters: status, step, epochs done, merged in the current epoch, last epoch's metrics."""
        if self._res is not None:
            return {k: v for k, v in self._res.items() if k != "store"}
        return self._ask("vcdask_status")

    def done(self) -> bool:
        """Whether the run has ended (finished, failed or cancelled)."""
        return self.status()["status"] in _ENDED

    def cancelled(self) -> bool:
        """Whether the run was cancelled (:meth:`cancel`)."""
        return self.status()["status"] == "cancelled"

    def cancel(self, reason: str = "cancelled by the user") -> bool:
        """Stop the run for good: no more shards are dispatched, those in flight are cancelled, and what
        was merged is committed, so the store stays readable at the run's head
        (``vcdask.load(store, branch=run_id)``).  :meth:`result` then raises :class:`RunCancelledError`.

        Unlike :meth:`concurrent.futures.Future.cancel`, this blocks until the run has ended (its
        last commit is in the store: a few seconds, the time of the shards being merged).  A handle
        that owns its client closes it afterwards.

        Returns
        -------
        bool
            True when the run is cancelled, by this call or already before it (as
            :meth:`concurrent.futures.Future.cancel` answers); False when it had ended otherwise (finished or
            failed), or was already stopping for another reason (:meth:`stop`, a target reached: it ends with
            a result).
        """
        if self._res is not None:
            return self._res["status"] == "cancelled"
        status = self._ask("vcdask_stop", reason=reason, cancel=True)
        if status["status"] in _ENDED:
            return status["status"] == "cancelled"
        if status["stopping"] != reason:
            return False  # the run was already stopping for another reason (it will finish with a result)
        self.wait()
        with self._lock:
            self._res = self._ask("vcdask_result")
        self.close()
        return True

    def add_done_callback(self, fn) -> None:
        """Call ``fn(handle)`` once the run has ended, from a background thread (at once if it has)."""
        import threading

        def watch() -> None:
            try:
                self.wait()
            finally:
                fn(self)

        threading.Thread(target=watch, name=f"vcdask-done-{self.run_id[-6:]}", daemon=True).start()

    def panel(self):
        """Display the live progress panel of this run in a notebook (also after re-attaching to a
        running run); it follows the run's events until the run ends, beside any other panel or
        progress bar of the run.  The panel of a run that has ended shows its final state (from the result
        this handle kept, once it has closed its client).

        Returns
        -------
        vcdask.panel.RunPanel
        """
        from .panel import RunPanel

        return RunPanel(self)

    def stop(self, reason: str = "stopped by the user") -> dict:
        """Stop dispatching; the run commits what it merged and finishes (with a result, unlike :meth:`cancel`).

        The run validates its final version first, unless that version was validated already or no usable
        worker is connected to do it (the run then ends at once, its ``metrics`` empty).

        Returns
        -------
        dict
            The run's status (that of its end when it had ended: nothing to stop).
        """
        if self._res is not None:
            return self.status()
        return self._ask("vcdask_stop", reason=reason)

    def wait(self, timeout: float | None = None, progress: bool = False) -> dict:
        """Block until the run ends (or ``timeout`` seconds pass); Ctrl-C stops the run.

        Returns
        -------
        dict
            The last status.

        Raises
        ------
        RuntimeError
            The handle's client was closed, also while this waited (it says how to reach the run again).
        """
        import time

        from .progress import make_progress

        if self._res is not None:
            return self.status()
        self._check_open()

        bar = make_progress(self, enabled=progress)
        if progress:
            self.display = bar
        status = None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                step = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                status = self._ask("vcdask_wait", timeout=step)
                bar.update(status)
                if status["status"] in _ENDED or (deadline is not None and time.monotonic() >= deadline):
                    return status
        except KeyboardInterrupt:
            status = self._stop_interrupted(status)
            raise
        finally:
            bar.close(status)

    def _stop_interrupted(self, status: dict | None) -> dict | None:
        """Ctrl-C (or SIGTERM in a job) while waiting: stop the run and wait, at most
        ``vcdask.interrupt-grace`` seconds, for it to commit what it merged and end as stopped; a
        second Ctrl-C leaves at once (the run goes on, as after ``wait=False``)."""
        import sys
        import time

        from . import config

        try:
            self.stop("interrupted")
            print(
                f"vcdask: stopping run {self.run_id}: committing what it merged (Ctrl-C again to leave now)",
                file=sys.stderr,
                flush=True,
            )
            deadline = time.monotonic() + float(config.get("interrupt-grace"))
            while time.monotonic() < deadline:
                status = self._ask("vcdask_wait", timeout=0.5)
                if status["status"] in _ENDED:
                    break
        except KeyboardInterrupt:
            pass
        except Exception as e:  # noqa: BLE001 - the interrupt is what the caller hears of
            print(f"vcdask: could not stop run {self.run_id}: {e}", file=sys.stderr, flush=True)
        return status

    def result(
        self, timeout: float | None = None, *, model: torch.nn.Module | None = None, wall_time: float | None = None
    ) -> FitResult:
        """Wait for the run and return its :class:`FitResult`.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most; default: until the run ends.
        model : torch.nn.Module, optional
            Module to load the final parameters into; default the one given to ``fit`` (for a handle
            from ``fit(wait=False)``), else a copy of the run's model.
        wall_time : float, optional
            What ``FitResult.wall_time`` reports; default the run's own time plus its staging.

        Raises
        ------
        TimeoutError
            The run is still going after ``timeout`` seconds (it goes on; ask again later).
        RunCancelledError
            The run was cancelled (a :class:`concurrent.futures.CancelledError`).
        RunFailedError
            The run ended with an error.
        RuntimeError
            The handle's client was closed, also while this waited (it says how to reach the run again).
        TypeError
            ``timeout`` is not a number (a model passed positionally: pass ``model=``).
        """
        if isinstance(timeout, torch.nn.Module):
            raise TypeError(
                f"result()'s first argument is timeout (seconds), got a {type(timeout).__name__}: "
                "pass the module by keyword, handle.result(model=my_model)"
            )
        if timeout is not None and not is_real(timeout):
            raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
        if self._res is None:
            status = self.wait(timeout)
            if status["status"] not in _ENDED:
                raise TimeoutError(
                    f"run {self.run_id} is still {status['status']} after {timeout} s "
                    f"({status['epochs_done']}/{status['max_epochs']} epochs); it goes on: call result() again"
                )
        with self._lock:  # `await handle` and a done callback may ask at once: collect once
            if self._result is not None and model is None:
                return self._result
            if self._res is None:
                self._res = self._ask("vcdask_result")
                self._owner.run_id = None  # (collected: the scheduler knows)
                self.close()  # the run ended: a client this handle owns is no longer needed
            panel = self.display if type(self.display).__name__ == "RunPanel" else None
            result = result_of(
                self.run_id,
                self._res,
                model if model is not None else self._model,
                wall_time=wall_time,
                setup_seconds=self._setup_seconds,
                panel=panel,
            )
            if model is None:
                self._result = result
            return result
