"""The scheduler plugin: hosts every run on the scheduler and routes clients' and tasks' messages to them.

Runs live on the scheduler, not in the process that called ``fit``: each run (:class:`~.run.Run`, the
run's shell around its core) drives its shard tasks through an asynchronous Dask client opened inside
the scheduler, keeps the server parameters ``W_s`` in memory, and merges each arriving update in a
dedicated thread (read ``W_c`` from the store, apply the merge rule, commit), so the scheduler's event
loop only ever handles small records.  Clients talk to it through the handlers below
(``client.scheduler.vcdask_status(run_id=...)``), as distributed's shuffle plugin does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import time

from distributed import SchedulerPlugin

from .. import config
from ..errors import RunNotFoundError, SchedulerEnvironmentError
from ..spec import load_spec
from . import policy, scaling
from .events import drop_topics
from .identify import identify
from .run import Run

logger = logging.getLogger(__name__)

__all__ = ["PLUGIN_NAME", "RunNotFoundError", "VcdaskPlugin"]

PLUGIN_NAME = "vcdask"
#: How long a closing scheduler waits for its runs' drivers to end (their records written; seconds).
CLOSE_GRACE = 5.0


def ended_runs_kept() -> int:
    """``vcdask.scheduler.ended-runs-kept``, checked."""
    value = config.get("scheduler.ended-runs-kept")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"vcdask.scheduler.ended-runs-kept must be an integer >= 0, got {value!r}")
    return value


class VcdaskPlugin(SchedulerPlugin):
    """Registered once per scheduler by :func:`vcdask.fit`; hosts any number of runs."""

    name = PLUGIN_NAME
    #: A second registration (two clients starting their first runs at once) is skipped by the scheduler:
    #: replacing the plugin took over its handlers and orphaned the runs the first one drove.
    idempotent = True

    def __init__(self) -> None:
        self.runs: dict[str, Run] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        #: Starts under way (reading the run's spec): a second start of the same run waits for the first
        self._starting: dict[str, asyncio.Future] = {}
        #: Runs whose result a handle has collected, and how many ended runs were dropped from ``runs``
        #: (``vcdask.scheduler.ended-runs-kept``)
        self._collected: set[str] = set()
        #: The handles (ids) that hold each run's session: its fit's or resume's, and attach's; each lets go when
        #: it is dropped, closed or interrupted, and a run none holds may be dropped once it ended, as Dask drops
        #: a result no future holds (a run started without a holder, by an older client, is held till collected)
        self._holders: dict[str, set[str]] = {}
        self._dropped = 0
        self._asking: set[asyncio.Future] = set()  # joining workers asked what they are (engine.identify)

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update(
            {
                "vcdask_start": self.handle_start,
                "vcdask_status": self.handle_status,
                "vcdask_result": self.handle_result,
                "vcdask_wait": self.handle_wait,
                "vcdask_stop": self.handle_stop,
                "vcdask_reissue": self.handle_reissue,
                "vcdask_runs": self.handle_runs,
                "vcdask_missing": self.handle_missing,
                "vcdask_preempt": self.handle_preempt,
                "vcdask_started": self.handle_started,
                "vcdask_base": self.handle_base,
                "vcdask_finished": self.handle_finished,
                "vcdask_panel": self.handle_panel,
                "vcdask_release": self.handle_release,
                "vcdask_hold": self.handle_hold,
            }
        )
        # (cluster.adapt sizes the cluster by the tasks the scheduler holds, and a run queues none there)
        scaling.install(scheduler, lambda: [run.state for run in self._live()])

    async def close(self) -> None:
        """The scheduler closes: each run's driver is cancelled and given :data:`CLOSE_GRACE` seconds to write its
        record (``stop_kind`` ``shutdown``: not over, :func:`vcdask.resume` continues it)."""
        drivers = list(self.tasks.values())
        for task in drivers:
            task.cancel()
        if drivers:
            await asyncio.wait(drivers, timeout=CLOSE_GRACE)
        # (distributed keeps a closed scheduler's handlers, this plugin's bound methods among them, for the life of
        # the process: the runs go, not the shell)
        self.runs.clear()
        self.tasks.clear()
        self._collected.clear()
        self._holders.clear()

    # -- scheduler hooks: the runs' worker pools follow the cluster ------------------------------
    def add_worker(self, scheduler=None, worker: str = "") -> None:
        ws = self.scheduler.workers.get(worker)
        live = self._live()
        for run in live:
            run.joined(worker, ws.nthreads if ws is not None else 1)
        if live:  # (what it costs from now, its instance, and whether its vcdask is ours: asked at once)
            asking = asyncio.ensure_future(identify(self.scheduler, worker, self._live))
            self._asking.add(asking)
            asking.add_done_callback(self._asking.discard)

    def remove_worker(self, scheduler=None, worker: str = "", **kwargs) -> None:
        for run in self._live():
            run.left(worker)

    def copies(self) -> list[dict]:
        """The shard copies in flight in the live runs, one row each (``status()["tasks"]``, with ``run_id``):
        key, epoch, shard, attempt, whether it started (``started_on`` the worker it said), got its base
        (``based``), is overdue, where Dask has it (``worker``, ``state``), and whether its shard is merged."""
        return [{"run_id": run.id, **row} for run in self._live() for row in run.status_dict()["tasks"]]

    def footprint(self, run_id: str) -> dict[str, int]:
        """Bytes a run holds on the scheduler, parameter-sized: ``params`` (``W_s``), ``rule_state``,
        ``bases`` and ``model``; a run that ended keeps none (only its small result)."""
        run = self._run(run_id)
        model = run.spec.model
        held = sum(t.numel() * t.element_size() for t in model.state_dict().values()) if model is not None else 0
        return {**run.server.footprint(), "model": held}

    def _live(self) -> list[Run]:
        return [run for run in self.runs.values() if not run.done.is_set()]

    def _run(self, run_id: str) -> Run:
        try:
            return self.runs[run_id]
        except KeyError:
            raise RunNotFoundError(self._not_found(run_id)) from None

    def _not_found(self, run_id: str) -> str:
        """Why ``run_id`` is not here: the runs there are, and whether ended ones were dropped."""
        said = f"no vcdask run {run_id!r} on {self.scheduler.address}; runs: {sorted(self.runs)}"
        if self._dropped:
            said += (
                f" ({self._dropped} ended runs were dropped from its memory, beyond the newest "
                f"vcdask.scheduler.ended-runs-kept={ended_runs_kept()}; a run's versions stay in its store: "
                "vcdask.load(store, branch=run_id))"
            )
        return said

    async def handle_start(
        self,
        comm=None,
        store: bytes = b"",
        run_id: str = "",
        resume: bool = False,
        max_epochs: int | None = None,
        holder: str | None = None,
    ) -> str:
        """Load the run's spec from the store (off the loop) and start driving it.

        With ``resume=True`` the run continues from its branch and folder in the store (after
        the scheduler that drove it died, or to train more epochs: ``max_epochs``).  A run still going here
        is that run (its id is returned); one that is ending (stopped, cancelled, or its last epoch done) is
        waited for, then started afresh from what it committed."""
        ended_runs_kept()  # (checked now: a bad value fails the start, not the end of a run)
        live = self.runs.get(run_id)
        if resume and live is not None and not live.done.is_set() and live.state.finished():
            await live.done.wait()  # (its last commit and its record are in: the new session goes on from them)
            return await self.handle_start(comm, store, run_id, resume, max_epochs, holder)
        if live is not None and not live.done.is_set():
            if max_epochs is not None and max_epochs != live.spec.max_epochs:
                raise ValueError(
                    f"run {run_id!r} is still going (epoch {len(live.state.ledger.epochs)} of {live.spec.max_epochs}): "
                    f"max_epochs={max_epochs} cannot change it now; wait for it to end (or cancel it), then "
                    "resume(run_id, max_epochs=...)"
                )
            if holder is not None and run_id in self._holders:  # (one more handle holds the session going on)
                self._holders[run_id].add(holder)
            return run_id
        starting = self._starting.get(run_id)
        if starting is not None:  # (two resumes at once: one driver, never two on one branch)
            await asyncio.wait([starting])
            return await self.handle_start(comm, store, run_id, resume, max_epochs, holder)
        loop = asyncio.get_running_loop()
        starting = self._starting[run_id] = loop.create_future()
        try:
            store_obj = pickle.loads(store)
            spec = await loop.run_in_executor(None, self._load_spec, store_obj, run_id)
            if max_epochs is not None:
                spec = dataclasses.replace(spec, max_epochs=max_epochs)
            try:  # (a metadata read; an outage is the run's to ride out, not the start's)
                head = await loop.run_in_executor(None, store_obj.head, spec.branch)
            except Exception:  # noqa: BLE001
                head = None
            run = self.runs[run_id] = Run(self.scheduler, spec, resume=resume)
            self._collected.discard(run_id)
            self._holders.pop(run_id, None)  # (a new session: an earlier one's handles let go of that one only)
            if holder is not None:
                self._holders[run_id] = {holder}
            run.state.head_at_start = head
            task = self.tasks[run_id] = asyncio.ensure_future(run.drive())
            task.add_done_callback(self._forget_task)
        finally:
            del self._starting[run_id]
            starting.set_result(None)
        return run_id

    def _load_spec(self, store, run_id: str):
        """The run's spec; one that needs a module the scheduler cannot import (the module of the user's model
        class) is a :class:`~vcdask.errors.SchedulerEnvironmentError` naming the scheduler and the remedies."""
        try:
            return load_spec(store, run_id)
        except (ImportError, AttributeError) as e:  # (unpickling: a module, or a name in it, not here)
            from .._worker_spec import missing_module

            address = self.scheduler.address
            module = missing_module(e)
            what = f"module {module!r}" if module else "the module of the run's model class (or of its data, its loss)"
            raise SchedulerEnvironmentError(
                f"the scheduler {address} cannot load run {run_id}'s model: {type(e).__name__}: {e}; the scheduler "
                f"reads the run's spec too: install {what} where the scheduler runs (the same version as the "
                "client's), send it with client.upload_file(...) (it reaches the scheduler as well as the workers), "
                "or define the class in the script's __main__ (pickled by value)",
                process=address,
            ) from e

    def _forget_task(self, task: asyncio.Task) -> None:
        """A run's driver returned: drop its task (the Run keeps only its small result, see engine.end), and
        the oldest ended runs beyond ``vcdask.scheduler.ended-runs-kept``."""
        for run_id, t in list(self.tasks.items()):
            if t is task:
                del self.tasks[run_id]
        self._prune()

    def _prune(self) -> None:
        """Drop the oldest ended runs beyond ``vcdask.scheduler.ended-runs-kept`` whose result a handle has
        collected or let go of (one a handle may still collect is kept, as Dask keeps a result while a future
        holds it), and the event
        topics of every run no longer here (:func:`~.events.drop_topics`: the scheduler kept them for good)."""
        ended = [run_id for run_id, run in self.runs.items() if run.done.is_set() and run_id not in self._starting]
        excess = len(ended) - ended_runs_kept()
        let_go = [run_id for run_id in ended if run_id in self._collected or self._holders.get(run_id) == set()]
        for run_id in let_go[: max(0, excess)]:
            del self.runs[run_id]
            self._collected.discard(run_id)
            self._holders.pop(run_id, None)
            self._dropped += 1
        try:
            drop_topics(self.scheduler, [*self.runs, *self._starting])
        except Exception:  # (distributed's broker is not public: its memory is not worth a run)
            logger.debug("could not drop the topics of the runs dropped", exc_info=True)

    async def handle_status(self, comm=None, run_id: str = "") -> dict:
        return self._run(run_id).status_dict()

    async def handle_panel(self, comm=None, run_id: str = "") -> dict:
        """What a progress panel shows, now (then it follows the run's events, topic ``vcdask-run-<id>``)."""
        return self._run(run_id).panel_state()

    async def handle_result(self, comm=None, run_id: str = "") -> dict:
        run = self._run(run_id)
        result = {**run.result_dict(), "store": pickle.dumps(run.store)}
        if run.done.is_set():
            self._collected.add(run_id)
            self._prune()
        return result

    async def handle_hold(self, comm=None, run_id: str = "", holder: str = "") -> None:
        """A handle (``vcdask.attach``'s) holds ``run_id``'s session: it is kept while one does."""
        if run_id in self._holders:
            self._holders[run_id].add(holder)

    async def handle_release(self, comm=None, run_id: str = "", holder: str = "") -> None:
        """The handle ``holder`` let go of ``run_id`` (dropped, closed, or its wait interrupted); a run none
        holds may be dropped once it ended, as a collected one is.  A handle of an earlier session of the run,
        or of another scheduler's, holds nothing here: its release changes nothing."""
        holders = self._holders.get(run_id)
        if holders is not None and holder in holders:
            holders.discard(holder)
            self._prune()

    async def handle_wait(self, comm=None, run_id: str = "", timeout: float | None = None) -> dict:
        run = self._run(run_id)
        try:
            await asyncio.wait_for(run.done.wait(), timeout)
        except TimeoutError:
            pass
        return run.status_dict()

    async def handle_stop(
        self, comm=None, run_id: str = "", reason: str = "stopped by the user", cancel: bool = False
    ) -> dict:
        """Stop dispatching, cancel the shards in flight, commit what is merged, and finish (with
        ``cancel``: the run ends "cancelled")."""
        run = self._run(run_id)
        await run.stop(reason, cancel)
        return run.status_dict()

    async def handle_reissue(self, comm=None, run_id: str = "", epoch: int = 0, shard: int = 0) -> str | None:
        return self._run(run_id).reissue(epoch, shard)

    async def handle_runs(self, comm=None) -> dict:
        return {run_id: run.status for run_id, run in self.runs.items()}

    async def handle_missing(self, comm=None, run_id: str = "") -> str | None:
        """None when this scheduler has the run; else why not (:class:`RunNotFoundError`'s message)."""
        return None if run_id in self.runs else self._not_found(run_id)

    def live_runs(self) -> list[str]:
        """The ids of the runs still going (``vcdask.cluster`` keeps a cluster that has some)."""
        return [run.id for run in self._live()]

    async def handle_preempt(
        self, comm=None, worker: str = "", retire: bool = True, window: float | None = None, reason: str = ""
    ) -> dict:
        """A worker will be reclaimed (in ``window`` seconds, if known): every run stops giving it shards
        and moves its queued ones; a running copy that fits the window is let finish (see
        :mod:`vcdask.engine.core.watching`); then the worker is retired gracefully.  Nothing is counted as a
        failure.  Returns run id -> keys of the copies re-issued."""
        if window is not None and not (isinstance(window, (int, float)) and window >= 0):
            raise ValueError(f"window must be a number of seconds >= 0 or None, got {window!r}")
        logger.warning("preemption notice for %s%s", worker, f" ({reason})" if reason else "")
        answers = {run.id: (run, *run.preempt(worker, window)) for run in self._live()}
        kept = [(run, keys) for run, _, keys in answers.values() if keys]
        if (retire and worker in self.scheduler.workers) or (kept and window is not None):
            asyncio.ensure_future(self._settle(worker, kept, window, retire))
        return {run_id: moved for run_id, (_, moved, _) in answers.items()}

    async def _settle(self, worker: str, kept: list, window: float | None, retire: bool) -> None:
        """Re-issue the copies let finish on ``worker`` that still run there at the notice's margin; then
        (``retire``) retire it."""
        if kept and window is not None:
            deadline = time.monotonic() + max(0.0, window - policy.NOTICE_MARGIN)
            await asyncio.gather(*(run.settle(worker, keys, deadline) for run, keys in kept))
        if retire and worker in self.scheduler.workers:
            await self.scheduler.retire_workers(
                workers=[worker], close_workers=True, stimulus_id=f"vcdask-preempt-{worker}"
            )

    def handle_started(
        self, comm=None, run_id: str = "", key: str = "", worker: str = "", instance=None, market=None
    ) -> None:
        """A shard task began to run on ``worker`` (sent by the task itself, with what the worker runs
        on, for the cost accounting).  A start recorded already on that worker stands (its clock runs
        from the first: with ``overlap="delta"`` the answer that brings a copy's base may come first)."""
        run = self.runs.get(run_id)
        if run is not None:
            run.task_started(key, worker, instance, market)

    async def handle_finished(
        self, comm=None, run_id: str = "", key: str = "", worker: str = "", record=None, next_base: bool = False
    ) -> dict | None:
        """A task's record, sent by the task as it finishes: the run need not wait for Dask to report
        the task done and then fetch its result (see :meth:`Run.hand_over`).

        ``next_base``: the worker would take the base of the shard copy it runs next with the answer
        (``{"next": {"key": ..., "version": ..., "step": ...}}``), once the run has merged the results
        that came before (see :func:`vcdask.engine.handshake.next_base`); the copy is recorded as started,
        as far as this answer knows (unless it said so itself: with ``vcdask.worker.overlap="delta"`` it
        starts before this answer): it may wait on the worker behind other work, and says when it begins.
        """
        run = self.runs.get(run_id)
        if run is None or run.done.is_set() or not isinstance(record, dict):
            return None
        nxt = run.hand_over(key, record)
        if not next_base or nxt is None:
            return None
        base = await run.next_base(nxt, worker)
        if base is None:
            return None
        run.task_started(nxt, worker, record.get("instance"), record.get("market"), handed=True)
        return {"next": {"key": nxt, **base}}

    async def handle_base(
        self, comm=None, run_id: str = "", key: str = "", worker: str = "", started: dict | None = None
    ) -> dict | None:
        """The version a shard task that is ready to train starts from (see :func:`vcdask.engine.handshake.base_for`).

        ``started``: the task began just now and says so with this request (what
        :meth:`handle_started` gets otherwise): a warm worker had its spec and rows at hand.
        """
        if started is not None:
            self.handle_started(run_id=run_id, key=key, worker=worker, **started)
        run = self.runs.get(run_id)
        return None if run is None else await run.base_for(key, worker)
