"""One training run, driven from inside the scheduler: the loop that wires the engine's parts.

The loop runs on the scheduler's event loop and only handles small records.  Its parts:
:mod:`~.dispatch` (what goes out next), :mod:`~.pool` (who may run it), :mod:`~.inflight` (what is
out), :mod:`~.ledger` (what came back), :mod:`~.policy` (decisions), :mod:`~.faults` and
:mod:`~.watch` (what went wrong), :mod:`~.params_server` (``W_s``, touched only by the run's merge
thread) and :mod:`~.events` (what followers see).
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Collection
from typing import Any

from .. import config
from ..errors import NoWorkersError
from ..spec import RunSpec
from ..worker import train_shard, validate_version
from . import arrivals, end, faults, handshake, notice, results, validations, views, watch
from .dispatch import Dispatcher
from .events import EventLog, train_key, validate_key
from .guard import Guard
from .handshake import Handshake
from .inflight import InFlight, TaskRecord
from .lane import MergeLane
from .ledger import Ledger
from .outage import StoreOutage
from .params_server import ParamsServer
from .policy import staleness_limit
from .pool import WorkerPool
from .recovery import recover

logger = logging.getLogger(__name__)

__all__ = ["Run"]


class Run:
    """One training run on a scheduler (see :mod:`vcdask.engine.plugin` for how clients reach it)."""

    def __init__(self, scheduler: Any, spec: RunSpec, resume: bool = False):
        self.scheduler, self.spec, self.resume = scheduler, spec, resume
        self.res, self.store, self.id = spec.resilience, spec.store, spec.run_id
        self.status: str = "starting"
        #: the branch's head when the run was started (its initial version, or where a resumed run goes on):
        #: what ``status`` shows until the run's server has loaded it
        self.head_at_start: str | None = None
        self.error: str | None = None
        self.done = asyncio.Event()
        self.started = time.time()
        self.events = EventLog(scheduler, self.id)
        self.server = ParamsServer(
            spec.store,
            spec.branch,
            spec.merge,
            spec.run_id,
            commit_every=spec.commit_every,
            keep_updates=spec.keep_updates,
            max_update_norm=self.res.max_update_norm,
            guard=Guard(spec) if Guard.wanted(spec) else None,
            outage_timeout=self.res.store_outage_timeout,
            retention=spec.retention,
            inline_bytes=config.get("worker.inline-base-bytes"),
            # (a compressed update is decoded on its base version: its id must be known to the worker)
            drafts=bool(config.get("worker.base-before-commit")) and spec.compression is None,
        )
        self.lane = MergeLane(self.server, f"vcdask-merge-{self.id[-6:]}")  # the merge thread and its calls
        self.pool = WorkerPool(
            self.res, spec.tasks_per_slot, {a: ws.nthreads for a, ws in scheduler.workers.items()}, clock=self.now
        )
        self.dispatch = Dispatcher(spec.shards.n_shards, spec.max_epochs, spec.seed)
        self.ledger = Ledger(
            spec.shards.n_shards,
            spec.max_epochs,
            validated=spec.validation is not None,
            target=spec.target,
            events=self.events,
            clock=self.now,
            patience=spec.patience,
            monitor=spec.monitor,
        )
        self.tasks = InFlight(scheduler)
        self.outage = StoreOutage(self.res.store_outage_timeout)  # store faults seen by tasks
        self.stopping: str | None = None
        self.cancelled = False  # stopped by RunHandle.cancel(): it ends "cancelled", without a result
        self.ended: float | None = None  # time.time() when the driver returned
        self.final: dict[str, Any] | None = None  # the result dict, kept once the run has ended
        self.idle_since: float | None = None  # since when no usable worker is connected
        self.no_workers: str | None = None  # why the run waits for workers (status()["paused"])
        self.handshake = Handshake()  # the results taken and settled, and the tasks waiting for them
        self._handed_any = asyncio.Event()  # set when a record is handed over (self.tasks.handed)
        self.handed_over = 0  # records taken that way
        self._taking = True  # False once the driver's loop is over: hand-overs are left to Dask then

    def now(self) -> float:
        return time.time() - self.started

    def staleness_limit(self) -> int | None:
        return staleness_limit(self.res.max_staleness, self.spec.shards.n_shards, self.pool.slots())

    def finished(self) -> bool:
        return self.stopping is not None or self.ledger.finished()

    # -- the driver -----------------------------------------------------------------------------
    async def drive(self) -> None:
        watchdog = None
        try:
            await self.tasks.open(f"vcdask-{self.id}")
            await (recover(self) if self.resume else self.lane.load())
            self.status = "running"
            await self.lane.call(end.write_record, self.store, self.id, end.running_record(self))
            self.events.emit("started", version=self.server.version, step=self.server.step)
            watchdog = asyncio.ensure_future(watch.deadlines(self))
            nxt = handed = None
            while not self.finished():
                self.check_workers()
                self.fill()
                if not self.tasks.tasks and not self.tasks.handed:
                    if self.server.folded:  # nothing more will come soon: commit the merges folded so far
                        await self._settle_folded()
                    await watch.idle(self)
                    continue
                if nxt is None and self.tasks.tasks:  # (each has its future in there until it is read)
                    nxt = asyncio.ensure_future(self.tasks.completed.__anext__())
                handed = handed or asyncio.ensure_future(self._handed_any.wait())
                # wake up now and then even if nothing completes: workers may have joined
                waits = {w for w in (nxt, handed, watchdog) if w is not None}
                await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if watchdog.done():
                    watchdog.result()  # the deadline watchdog failed (e.g. on_shard_failure="stop"): raise it
                if self.tasks.handed:
                    await self._on_record(*self.tasks.handed.popleft())
                    await self._settle_folded()
                elif handed.done():
                    self._handed_any.clear()
                    handed = None
                elif nxt is not None and nxt.done():
                    future, nxt = nxt.result(), None
                    await self._on_done(future)
                    await self._settle_folded()
            for waiting in (nxt, handed):
                if waiting is not None:
                    waiting.cancel()
            self._taking = False  # what is still out is the end's to cancel
            await end.finish(self)
        except asyncio.CancelledError:
            self.status = "cancelled"
            raise
        except Exception:  # noqa: BLE001 - the run's error is recorded and published, not swallowed
            self.status, self.error = "error", traceback.format_exc()
            logger.error("vcdask run %s failed:\n%s", self.id, self.error)
            self.events.emit("failed", error=self.error)
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await end.release(self)  # its record written; W_s and the model dropped
            self.done.set()

    def hand_over(self, key: str, record: dict[str, Any]) -> str | None:
        """A task's record, sent by the task as it finishes (see :func:`vcdask.worker.train_shard`).

        The run takes it now, a round trip sooner than from Dask (which reports the task done, then
        the run fetches its result), and even while the driver is busy merging the results before
        it: the worker gets its next shard at once (it queues there behind the finishing task), and
        the record waits in :attr:`InFlight.handed` for its merge.  Whichever of the two ways comes second
        finds the task taken and is dropped.

        Returns the key of the shard copy sent to the task's worker to run next (placed there), if
        any: its base can travel back with the hand-over's answer (:func:`~.handshake.next_base`).
        """
        if not self._taking:  # the run is ending: its end reads (or cancels) what is still out
            return None
        task = self.tasks.pop(key)
        if task is None:  # Dask's report came first, or the copy was given up
            return None
        self.tasks.stale.add(key)
        self.handed_over += 1
        self.tasks.handed.append((task, record))  # first: the record is the run's now, whatever happens below
        self._handed_any.set()
        try:
            sent = self._taken(task, record)
        except Exception:  # the driver fills the free slot on its next pass
            logger.warning("run %s: sending a worker its next shard failed", self.id, exc_info=True)
            return None
        worker = record.get("worker")
        return next((k for k in sent if getattr(self.tasks.tasks.get(k), "placed", None) == worker), None)

    def _taken(self, task: TaskRecord, record: dict[str, Any]) -> list[str]:
        """A shard result is in: its worker is free.  Give it its next shard before this result is
        merged, so the new task reads its spec and rows meanwhile; it then waits (briefly) for this
        merge before it trains (:func:`~.handshake.base_for`).  The keys of the shard copies sent."""
        if task.kind != "update":
            return []
        self.handshake.arrived += 1
        return [] if self.finished() else self.fill(record["worker"])

    async def _settle_folded(self) -> None:
        if self.server.folded and not self.tasks.results_waiting():  # the queue ran dry: commit the folded merges
            await self.lane.commit()
        self.handshake.note_settled()

    async def _on_done(self, future: Any) -> None:
        self.tasks.stale.discard(future.key)
        task = self.tasks.pop(future.key)
        if task is None:  # handed over by the task already, or given up
            future.release()
            return
        if future.status == "cancelled":
            if task.kind == "update":
                superseded = self.ledger.is_merged(task.epoch, task.shard)
                why = "superseded: another copy of this shard was merged" if superseded else self.stopping
                self.ledger.record_copy(task, "cancelled", f"cancelled: {why}")
            return
        try:
            record = await results.read(self, future, task)
        except NoWorkersError:
            raise  # the run's own verdict while it waited, not the task's failure
        except Exception as exc:  # noqa: BLE001 - a task's error is data for the failure policy
            await faults.task_failed(self, task, exc)
            return
        finally:
            future.release()
        if record is None:
            return  # lost with its worker (recorded, and re-issued)
        self._taken(task, record)
        await self._on_record(task, record)

    async def _on_record(self, task: TaskRecord, record: dict[str, Any]) -> None:
        """Record a validation, or merge a shard result (taken already: :meth:`_taken`)."""
        faults.store_back(self)
        if task.kind == "validation":
            arrivals.validation(self, record)
            return
        try:
            await arrivals.update(self, record, task)
        finally:
            self.handshake.settled += 1

    # -- dispatch -------------------------------------------------------------------------------
    def fill(self, freed_worker: str | None = None) -> list[str]:
        """Hand out shards until every slot is busy (parked work first); the keys of the shard copies sent."""
        sent: list[str | None] = []
        if not self.pool.usable() or self.outage.holding():
            return []  # nobody to run on (wait for workers to (re)join), or the store is out
        parked, self.dispatch.parked_validations = self.dispatch.parked_validations, []
        for version, step, retry in parked:
            self.submit_validation(version, step, retry)
        while self.stopping is None and self.tasks.training() < self.pool.slots():
            if self.dispatch.returned:
                epoch, shard = self.dispatch.returned.pop(0)
                if not self.ledger.is_merged(epoch, shard) and not self.tasks.copy_running(epoch, shard):
                    sent.append(self.submit_shard(epoch, shard))
                continue
            nxt = self.dispatch.next_shard(freed_worker)
            if nxt is None:
                break
            sent.append(self.submit_shard(*nxt))
            freed_worker = None
        return [key for key in sent if key is not None]

    def submit_shard(self, epoch: int, shard: int, avoid: str | Collection[str] | None = None) -> str | None:
        """Send a copy of (epoch, shard) to train from the newest version; its key.  None when no worker
        is usable: the shard is parked and sent first once one is (:meth:`fill`)."""
        avoided = faults.stuck_workers(self) | ({avoid} if isinstance(avoid, str) else set(avoid or ()))
        where = self.dispatch.placement(
            self.dispatch.home.get(shard), self.pool.usable(), len(self.pool.connected), avoided, self.busy_workers()
        )
        if where is None:
            self.dispatch.park(epoch, shard)
            return None
        attempt = self.dispatch.next_attempt(epoch, shard)
        head = self.server.head
        placed = where.get("workers", ())
        key = self.tasks.submit(
            train_shard,
            self.store,
            self.id,
            epoch,
            shard,
            attempt,
            head.version,
            head.version_step,
            self.dispatch.position(epoch, shard),
            key=train_key(self.id, epoch, shard, attempt),
            task=TaskRecord(
                "update",
                epoch,
                shard,
                attempt,
                head.version_step,
                submitted=time.monotonic(),
                placed=placed[0] if len(placed) == 1 else None,
            ),
            **where,
        )
        self.ledger.set_shard(epoch, shard, "queued" if attempt == 0 else "re-issued")
        return key

    def busy_workers(self) -> set[str]:
        """Workers that hold their share of shard copies (``WorkerPool.share``), running or queued
        there: a copy sent to one would wait while another worker is free."""
        return {a for a, n in self.tasks.held().items() if n >= self.pool.share(a)}

    def submit_validation(
        self, version: str | None = None, step: int | None = None, retry: int = 0, avoid: set[str] | None = None
    ) -> None:
        """Validate ``version`` (default: the newest committed one), once; on a usable worker, away from
        stuck ones and ``avoid`` (:func:`.validations.placement`), or parked until one is usable."""
        if version is None or step is None:
            head = self.server.head  # one read: the merge thread replaces it as a whole
            version, step = head.version, head.version_step
        key = validate_key(self.id, step, retry)
        if key in self.tasks.futures or step in self.ledger.validations or self.tasks.validating(step):
            return
        where = validations.placement(self, avoid or set())
        if where is None:
            self.dispatch.parked_validations.append((version, step, retry))
            return
        self.tasks.submit(
            validate_version,
            self.store,
            self.id,
            version,
            step,
            key=key,
            priority=10,
            task=TaskRecord("validation", attempt=retry, step=step, version=version, submitted=time.monotonic()),
            **where,
        )

    # -- results --------------------------------------------------------------------------------
    def close_epochs(self) -> None:
        stop = self.ledger.close_epochs()
        if stop is not None:
            self.stopping = stop

    # -- what the plugin's handlers and hooks call -------------------------------------------------
    stop = faults.stop
    reissue = faults.reissue
    preempt = notice.preempt
    check_workers = watch.check_workers
    task_started = watch.task_started
    base_for = handshake.base_for
    next_base = handshake.next_base
    status_dict = views.status_dict
    panel_state = views.panel_state
    result_dict = views.result_dict
