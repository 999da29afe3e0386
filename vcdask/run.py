"""One training run, driven from inside the scheduler: queue, deadlines, dedup, merges, history.

The driver runs on the scheduler's event loop and only ever handles small records; the
server parameters live in a :class:`~vcdask.server.ServerState` that only the run's merge
thread touches.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .errors import StoreAccessDeniedError, StoreError, StoreNotFoundError
from .history import TaskRecord, history_row
from .recovery import read_back
from .outage import StoreOutage
from .resilience import WorkerRecord, staleness_limit
from .server import ServerState
from .task import RunSpec, train_shard, validate_version

logger = logging.getLogger(__name__)

__all__ = ["Run"]

WATCH_INTERVAL = 0.2  # seconds between deadline checks


class NoWorkersError(RuntimeError):
    """The run had no usable worker for longer than ``no_worker_timeout``."""


class Run:
    """One training run on a scheduler (see :mod:`vcdask.plugin` for how clients reach it)."""

    def __init__(self, scheduler, spec: RunSpec, resume: bool = False):
        self.scheduler = scheduler
        self.resume = resume
        self.spec = spec
        self.res = spec.resilience
        self.store = spec.store
        self.id = spec.run_id
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"vcdask-merge-{self.id[-6:]}")
        self.status = "starting"
        self.error: str | None = None
        self.done = asyncio.Event()
        self.started = time.time()
        self.client = None
        self.ac = None
        # W_s: touched only by the merge thread; the loop reads its counters between merges
        self.state = ServerState(spec.store, spec.branch, spec.merge, spec.run_id, commit_every=spec.commit_every,
                                 keep_updates=spec.keep_updates,
                                 max_update_norm=self.res.max_update_norm,
                                 outage_timeout=self.res.store_outage_timeout)
        # scheduling state (event loop only)
        self.rng = random.Random(spec.seed)
        self.queue: dict[int, list[int]] = {}
        self.dispatch_epoch = 0
        self.merged: dict[int, set[int]] = {}
        self.skipped: dict[int, set[int]] = {}
        self.attempts: dict[tuple[int, int], int] = {}  # copies submitted (names their keys)
        self.failures: dict[tuple[int, int], int] = {}  # lost, timed out or rejected copies
        self.home: dict[int, str] = {}  # shard -> worker that last trained it (and caches its rows)
        self.workers: dict[str, WorkerRecord] = {}
        self.draining: set[str] = set()  # preempted workers: no new shards
        self.in_flight: dict[str, TaskRecord] = {}
        self.futures: dict[str, Any] = {}
        self.history: list[dict] = []
        self.shard_seconds: list[float] = []
        self.validations: dict[int, dict] = {}
        self.epoch_end: dict[int, tuple[int, float]] = {}  # epoch -> (step, wall seconds)
        self.epochs: list[dict] = []
        self.stopping: str | None = None
        self.idle_since: float | None = None  # since when no usable worker is connected
        self.no_workers: str | None = None  # why the run waits for workers (status()["paused"])
        # store outages seen by tasks: their shards wait in `returned` while the outage holds dispatch
        self.outage = StoreOutage(self.res.store_outage_timeout)
        self.returned: list[tuple[int, int]] = []
        self.parked_validations: list[tuple[str, int, int]] = []
        # what the progress panel's shard grid shows: (epoch, shard) -> state
        self.shard_state: dict[tuple[int, int], str] = {}

    # -- helpers ------------------------------------------------------------------------------
    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _event(self, kind: str, **data) -> None:
        self.scheduler.log_event(f"vcdask-run-{self.id}", {"type": kind, "run_id": self.id, **data})

    def _set_shard(self, epoch: int, shard: int, state: str) -> None:
        """Move (epoch, shard) to ``state`` for the panel's grid (merged and skipped are final; a
        rejection stays visible until a copy is merged) and push the change as an event."""
        old = self.shard_state.get((epoch, shard))
        if old == state or old in ("merged", "skipped") or (old == "rejected" and state in _ACTIVE):
            return
        self.shard_state[(epoch, shard)] = state
        self._event("shard", epoch=epoch, shard=shard, state=state)

    def _worker(self, address: str) -> WorkerRecord:
        rec = self.workers.get(address)
        if rec is None:
            rec = self.workers[address] = WorkerRecord(address)
        return rec

    def _usable(self) -> list[str]:
        """Workers that may get shards: alive, not excluded, not draining; most reliable and fastest first."""
        alive = [a for a in self.scheduler.workers if a not in self.draining
                 and not self._worker(a).excluded]
        return sorted(alive, key=lambda a: self._worker(a).rank())

    def _slots(self) -> int:
        threads = sum(self.scheduler.workers[a].nthreads for a in self._usable())
        return max(1, self.spec.tasks_per_slot * threads)

    def _staleness_limit(self) -> int | None:
        return staleness_limit(self.res.max_staleness, self.spec.shards.n_shards, self._slots())

    def _n_training(self) -> int:
        return sum(t.kind == "update" and not t.overdue for t in self.in_flight.values())

    def _now(self) -> float:
        return time.time() - self.started

    # -- the driver -------------------------------------------------------------------------
    async def drive(self) -> None:
        from distributed import Client, as_completed

        watchdog = None
        try:
            self.client = await Client(self.scheduler.address, asynchronous=True, set_as_default=False,
                                       name=f"vcdask-{self.id}")
            self.ac = as_completed([], loop=self.client.loop, with_results=False)
            if self.resume:
                await self._recover()
            else:
                await self._in_thread(self.state.load)
            self.status = "running"
            self._event("started", version=self.state.version, step=self.state.step)
            watchdog = asyncio.ensure_future(self._watch_deadlines())
            nxt = None
            while not self._finished():
                self._check_workers()
                self._fill(None)
                if not self.in_flight:
                    await self._wait_for_workers()
                    continue
                nxt = nxt or asyncio.ensure_future(self.ac.__anext__())
                # wake up now and then even if nothing completes: workers may have joined
                await asyncio.wait({nxt, watchdog}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if watchdog.done():
                    watchdog.result()  # the deadline watchdog failed (e.g. on_shard_failure="stop"): raise it
                if nxt.done():
                    future, nxt = nxt.result(), None
                    await self._on_done(future)
            if nxt is not None:
                nxt.cancel()
            await self._finish()
        except asyncio.CancelledError:
            self.status = "cancelled"
            raise
        except Exception:
            self.status = "error"
            self.error = traceback.format_exc()
            logger.error("vcdask run %s failed:\n%s", self.id, self.error)
            self._event("failed", error=self.error)
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await self._cleanup()
            self.done.set()

    def _check_workers(self) -> None:
        """Track whether a usable worker is connected.  Without one the run waits (tasks already
        submitted stay queued at the scheduler) and fails once it has waited ``no_worker_timeout``."""
        now = time.monotonic()
        if self._usable():
            if self.idle_since is not None:
                logger.warning("run %s: usable workers again after %.0f s", self.id, now - self.idle_since)
                self._event("resumed", cause="workers", after=now - self.idle_since)
                for task in self.in_flight.values():  # copies queued meanwhile start their clocks now
                    if task.started is None:
                        task.submitted = now
            self.idle_since, self.no_workers = None, None
            return
        states = {a: self._worker(a).excluded or "draining" for a in self.scheduler.workers}
        if self.idle_since is None:
            self.idle_since = now
            logger.warning("run %s: no usable worker (connected: %s); waiting up to %.0f s", self.id,
                           states or "none", self.res.no_worker_timeout)
            self._event("paused", cause="workers", why=f"no usable worker (connected: {len(states)})")
        elif now - self.idle_since > self.res.no_worker_timeout:
            raise NoWorkersError(f"run {self.id} had no usable worker for {self.res.no_worker_timeout:.0f} s "
                                 f"(no_worker_timeout; connected workers: {states or 'none'})")
        self.no_workers = (f"no usable worker for {now - self.idle_since:.0f} s "
                           f"(connected: {len(states)}; no_worker_timeout={self.res.no_worker_timeout:g} s)")

    async def _wait_for_workers(self) -> None:
        """Nothing in flight: wait for usable workers, for the store, or find the run stuck."""
        if self._usable() and not (self.outage.holding() or self.returned or self.parked_validations):
            if self.dispatch_epoch >= self.spec.max_epochs and not self.queue.get(self.dispatch_epoch):
                raise RuntimeError(f"run {self.id} has nothing left to run or wait for, but epoch "
                                   f"{len(self.epochs) + 1} is not complete")
        await asyncio.sleep(WATCH_INTERVAL)

    async def _on_done(self, future) -> None:
        task = self.in_flight.pop(future.key, None)
        self.futures.pop(future.key, None)
        if task is None:
            return
        if future.status == "cancelled":
            if task.kind == "update":
                why = ("superseded: another copy of this shard was merged"
                       if task.shard in self.merged.get(task.epoch, ()) else self.stopping)
                self.history.append(history_row(task.epoch, task.shard, task.attempt, base_version=task.step,
                                                reason=f"cancelled: {why}", time=self._now()))
            return
        try:
            record = await self._result(future)
        except NoWorkersError:
            raise  # the run's own verdict while it waited, not the task's failure
        except Exception as exc:  # noqa: BLE001 - a task's error is data for the failure policy
            await self._task_failed(task, exc, future)
            return
        finally:
            future.release()
        self._store_back()
        if task.kind == "validation":
            self._on_validation(record)
            return
        # The worker is free: give it its next shard before merging this result, so training never
        # waits for the merge thread (the new task starts from the newest committed version).
        if not self._finished():
            self._fill(record["worker"])
        await self._on_update(record, task)

    async def _result(self, future) -> dict:
        """The finished task's result record (a few hundred bytes, held by the worker that ran it).

        If that worker dies before handing it over, Dask runs the task again once a worker is there;
        meanwhile the run keeps watching the pool (``no_worker_timeout``) instead of waiting blind."""
        fetch = asyncio.ensure_future(_await(future))
        try:
            while True:
                done, _ = await asyncio.wait({fetch}, timeout=1.0)
                if done:
                    return fetch.result()
                self._check_workers()
        finally:
            fetch.cancel()

    def _finished(self) -> bool:
        return self.stopping is not None or len(self.epochs) >= self.spec.max_epochs

    # -- resuming after the scheduler died --------------------------------------------------------
    async def _recover(self) -> None:
        """Rebuild the run from its branch and its folder: ``W_s`` and the merged (epoch, shard) from
        the versions' metadata, then merge the uploads that no committed version contains."""
        merged, ends, attempts, pending = await self._in_thread(
            read_back, self.state, self.store, self.spec.branch, self.id, self.spec.shards.n_shards)
        self.merged, self.attempts = merged, attempts
        last = max([*merged, *(m["epoch"] for m in pending), 0])
        for epoch in range(1, last + 1):
            todo = [s for s in range(self.spec.shards.n_shards) if s not in merged.setdefault(epoch, set())]
            self.rng.shuffle(todo)
            self.queue[epoch] = todo
        for epoch, (step, version) in ends.items():  # epochs finished before the restart
            self.epoch_end[epoch] = (step, float("nan"))
            if self.spec.validation is not None:
                self._submit_validation(version, step)
        logger.info("run %s resumed at step %d: %d updates merged before, %d uploaded but unmerged", self.id,
                    self.state.step, sum(map(len, merged.values())), len(pending))
        for meta in pending:
            queue = self.queue.get(meta["epoch"], [])
            if meta["shard"] in queue:
                queue.remove(meta["shard"])
            rec = {"seconds": float("nan"), "upload_seconds": float("nan"), **meta}
            await self._on_update(rec, TaskRecord("update", meta["epoch"], meta["shard"], meta["attempt"],
                                             meta["base_step"]))
        self._close_epochs()

    # -- dispatch -------------------------------------------------------------------------------
    def _next_shard(self, worker: str | None) -> tuple[int, int] | None:
        while not self.queue.get(self.dispatch_epoch):
            if self.dispatch_epoch >= self.spec.max_epochs:
                return None
            self.dispatch_epoch += 1
            if self.dispatch_epoch not in self.queue:  # (a resumed run has its earlier queues already)
                order = list(range(self.spec.shards.n_shards))
                self.rng.shuffle(order)
                self.queue[self.dispatch_epoch] = order
            self.merged.setdefault(self.dispatch_epoch, set())
        queue = self.queue[self.dispatch_epoch]
        pick = next((s for s in queue if worker is not None and self.home.get(s) == worker), queue[0])
        queue.remove(pick)
        return self.dispatch_epoch, pick

    def _fill(self, freed_worker: str | None) -> None:
        if not self._usable() or self.outage.holding():
            return  # nobody to run on (wait for workers to (re)join), or the store is out
        while self.parked_validations:
            self._submit_validation(*self.parked_validations.pop(0))
        while self.stopping is None and self._n_training() < self._slots():
            if self.returned:
                epoch, shard = self.returned.pop(0)
                if shard not in self.merged.get(epoch, ()) and not self._copy_running(epoch, shard):
                    self._submit_shard(epoch, shard)
                continue
            nxt = self._next_shard(freed_worker)
            if nxt is None:
                return
            self._submit_shard(*nxt)
            freed_worker = None

    def _submit_shard(self, epoch: int, shard: int, avoid: str | None = None) -> str:
        attempt = self.attempts.get((epoch, shard), 0)
        self.attempts[(epoch, shard)] = attempt + 1
        key = f"vcdask-train-{self.id}-e{epoch}-s{shard}-a{attempt}"
        usable = [a for a in self._usable() if a != avoid] or self._usable()
        home = self.home.get(shard)
        if len(usable) < len(self.scheduler.workers):
            where = {"workers": usable}  # strict: keep away from excluded, draining or late workers
        elif home in usable:
            where = {"workers": [home], "allow_other_workers": True}  # sticky, yet free to move
        else:
            where = {}
        version, step = self.state.head
        future = self.client.submit(train_shard, self.store, self.id, epoch, shard, attempt, version, step,
                                    key=key, **where)
        self._track(future, TaskRecord("update", epoch, shard, attempt, step, submitted=time.monotonic()))
        self._set_shard(epoch, shard, "queued" if attempt == 0 else "re-issued")
        return key

    def _submit_validation(self, version: str | None = None, step: int | None = None, retry: int = 0) -> None:
        """Validate ``version`` (default: the newest committed one), once."""
        if version is None:
            version, step = self.state.head
        key = f"vcdask-validate-{self.id}-v{step}" + (f"-r{retry}" if retry else "")
        if key in self.futures or step in self.validations:
            return
        future = self.client.submit(validate_version, self.store, self.id, version, step, key=key, priority=10)
        self._track(future, TaskRecord("validation", attempt=retry, step=step, version=version,
                                  submitted=time.monotonic()))

    def _track(self, future, task: TaskRecord) -> None:
        self.in_flight[future.key] = task
        self.futures[future.key] = future
        self.ac.add(future)

    async def stop(self, reason: str) -> None:
        """Stop dispatching and cancel the shards in flight; the driver then commits and finishes."""
        if not self.done.is_set() and self.stopping is None:
            self.stopping = reason
            await self.client.cancel([f for k, f in self.futures.items() if self.in_flight[k].kind == "update"])

    def reissue(self, epoch: int, shard: int) -> str:
        """Train (epoch, shard) once more from the current version; the first valid result wins."""
        if self.ac is None or self.done.is_set():
            raise RuntimeError(f"run {self.id} is not running")
        self.merged.setdefault(epoch, set())
        return self._submit_shard(epoch, shard)

    def task_started(self, key: str, worker: str) -> None:
        task = self.in_flight.get(key)
        if task is not None:
            task.started, task.worker = time.monotonic(), worker
            if task.kind == "update":
                self._set_shard(task.epoch, task.shard, "running" if task.attempt == 0 else "re-issued")

    async def _watch_deadlines(self) -> None:
        """Re-issue shard tasks that run past their deadline, and the ones queued behind them."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            if self.stopping:
                continue
            deadline = self.res.deadline_for(self.shard_seconds, self.spec.tasks_per_slot)
            now = time.monotonic()
            redundant = [k for k, t in self.in_flight.items() if t.kind == "update"
                         and t.shard in self.merged.get(t.epoch, ()) and self._processing_on(k) is None]
            if redundant:  # copies of merged shards that no worker is running (e.g. theirs died)
                await self.client.cancel([self.futures[k] for k in redundant])
            if not self._usable():
                continue  # nowhere to re-issue to: copies wait at the scheduler for workers to join
            stale_after = self._staleness_limit()
            for key, task in list(self.in_flight.items()):
                if task.kind != "update" or task.overdue or task.shard in self.merged.get(task.epoch, ()):
                    continue
                behind = self.state.step - task.step
                if stale_after is not None and behind > stale_after:
                    # its result could only be rejected as stale: a fresh copy now, nobody blamed
                    await self._overdue(key, task, f"fell {behind} merges behind (max_staleness={stale_after})",
                                        self._processing_on(key), blame=False)
                    continue
                limit = deadline
                if task.worker is not None and self._worker(task.worker).done == 0:
                    limit = self.res.deadline_for(self.shard_seconds, self.spec.tasks_per_slot, cold=True)
                if task.started is not None and now - task.started > limit:
                    if self._processing_on(key) != task.worker:
                        task.started = None  # its worker died: Dask is moving it, it starts afresh
                        task.submitted = now
                        continue
                    await self._overdue(key, task, f"ran past its {limit:.1f} s deadline", task.worker)
                elif task.started is None and now - task.submitted > deadline * (self.spec.tasks_per_slot + 2):
                    await self._overdue(key, task, "never started", self._processing_on(key))

    def _processing_on(self, key: str) -> str | None:
        ts = self.scheduler.tasks.get(key)
        return ts.processing_on.address if ts is not None and ts.processing_on is not None else None

    async def _overdue(self, key: str, task: TaskRecord, why: str, worker: str | None, blame: bool = True) -> None:
        """Re-issue ``task`` elsewhere; a worker whose running task is late also loses its queue.

        With ``blame=False`` (the task fell too far behind the run, however fast its worker) neither
        the worker nor the shard is charged with a failure."""
        task.overdue = True
        logger.warning("run %s: shard %d of epoch %d %s on %s; re-issuing", self.id, task.shard, task.epoch,
                       why, worker)
        self._event("reissue", epoch=task.epoch, shard=task.shard, worker=worker, why=why)
        if not blame:
            await self._retry_or_give_up(task.epoch, task.shard, why, avoid=worker, count=False)
            return
        if worker is not None and task.started is not None:
            self._worker(worker).timed_out += 1
            self._maybe_exclude(worker)
            self._event("worker", worker_row=self._worker(worker).as_row())
            for other_key, other in list(self.in_flight.items()):  # stuck behind it: move, no blame
                if (other.kind == "update" and not other.overdue and other.started is None
                        and self._processing_on(other_key) == worker):
                    other.overdue = True
                    self._submit_shard(other.epoch, other.shard, avoid=worker)
        # a copy that never started (queued while workers died and restarted) is not the shard's failure
        await self._retry_or_give_up(task.epoch, task.shard, why, avoid=worker, count=task.started is not None)

    def _maybe_exclude(self, address: str) -> None:
        rec = self._worker(address)
        if rec.excluded is None and rec.faults >= self.res.max_worker_failures:
            rec.excluded = (f"{rec.failed} failed, {rec.timed_out} timed out, {rec.rejected} rejected "
                            f"(max_worker_failures={self.res.max_worker_failures})")
            logger.warning("run %s: excluding worker %s: %s", self.id, address, rec.excluded)
            self._event("excluded", worker=address, reason=rec.excluded, worker_row=rec.as_row())

    def preempt(self, address: str) -> list[str]:
        """A notice that ``address`` will be reclaimed: no new shards for it; its queued shards go elsewhere.

        Returns the keys of the copies re-issued.  Not counted as failures.
        """
        self.draining.add(address)
        self._worker(address).preempted = True
        moved = []
        for key, task in list(self.in_flight.items()):
            if task.kind == "update" and self._processing_on(key) == address and not task.overdue:
                task.overdue = True  # its slot is free; if it still finishes, the first result wins
                moved.append(self._submit_shard(task.epoch, task.shard, avoid=address))
        self._event("preempted", worker=address, reissued=len(moved), worker_row=self._worker(address).as_row())
        return moved

    # -- results ------------------------------------------------------------------------------
    async def _on_update(self, rec: dict, task: TaskRecord) -> None:
        epoch, shard, worker = rec["epoch"], rec["shard"], rec["worker"]
        row = history_row(epoch, shard, rec["attempt"], worker=worker, update=rec["update"],
                          base_version=rec["base_step"], train_loss=rec["train_loss"], seconds=rec["seconds"],
                          read_seconds=rec["read_seconds"], train_seconds=rec["train_seconds"],
                          upload_seconds=rec["upload_seconds"], time=self._now())
        wrec = self._worker(worker)
        wrec.done += 1
        wrec.seconds += rec["seconds"]
        merged = self.merged.setdefault(epoch, set())
        epoch_complete = False
        if shard in merged or shard in self.skipped.get(epoch, ()):
            row["reason"] = ("late: (epoch, shard) already merged from a re-issued copy" if task.overdue
                             else "duplicate: (epoch, shard) already merged")
            if not self.spec.keep_updates:
                await self._in_thread(self.store.files.delete, rec["update"])
        else:
            epoch_complete = len(merged) + len(self.skipped.get(epoch, ())) + 1 == self.spec.shards.n_shards
            outcome = await self._in_thread(self.state.merge, rec, epoch_complete, self._staleness_limit())
            fault = outcome.pop("fault", None)
            row.update(outcome)
            if row["accepted"]:
                merged.add(shard)
                self._set_shard(epoch, shard, "merged")
                self.home[shard] = worker
                await self._cancel_other_copies(epoch, shard)
                self.shard_seconds.append(rec["seconds"])
                if epoch_complete:
                    self.epoch_end[epoch] = (self.state.step, self._now())
            else:
                epoch_complete = False
                self._set_shard(epoch, shard, "rejected")
                if fault not in ("stale", "unreadable"):  # not the worker's fault: its base was old / the store
                    wrec.rejected += 1
                    self._maybe_exclude(worker)
                logger.warning("run %s: rejected the update of shard %d, epoch %d from %s: %s", self.id, shard,
                               epoch, worker, row["reason"])
                # an update that came back too stale is the pace's doing, not the shard's: re-issue, uncounted
                await self._retry_or_give_up(epoch, shard, row["reason"], avoid=worker, count=fault != "stale")
        self.history.append(row)
        self._event("update", worker_row=wrec.as_row(), version=self.state.version,
                    **{k: row[k] for k in ("epoch", "shard", "worker", "accepted", "new_version", "staleness",
                                           "alpha", "train_loss", "reason")})
        if not row["accepted"]:
            return
        if self.spec.validation is None:
            self._close_epochs()
            return
        due = epoch_complete or self.state.step % self.spec.validate_every == 0
        if self.state.committed and due:
            self._submit_validation()

    async def _cancel_other_copies(self, epoch: int, shard: int) -> None:
        """The first valid result won: cancel the copies of (epoch, shard) that have not started.

        A copy already running is left to finish (cancelling cannot stop a running task); if its
        result arrives it is discarded and recorded as late."""
        queued = [k for k, t in self.in_flight.items()
                  if t.kind == "update" and (t.epoch, t.shard) == (epoch, shard) and t.started is None]
        if queued:
            await self.client.cancel([self.futures[k] for k in queued])

    async def _retry_or_give_up(self, epoch: int, shard: int, why: str, avoid: str | None = None,
                                count: bool = True) -> None:
        """Re-issue (epoch, shard) unless it has used up its attempts; then apply ``on_shard_failure``."""
        failures = self.failures[(epoch, shard)] = self.failures.get((epoch, shard), 0) + int(count)
        if self._copy_running(epoch, shard):
            return  # another copy is still running
        if failures < self.res.max_attempts:
            self._submit_shard(epoch, shard, avoid=avoid)
            return
        message = f"shard {shard} of epoch {epoch} failed {failures} times (last: {why})"
        if self.res.on_shard_failure == "stop":
            raise RuntimeError(message + "; on_shard_failure='stop'")
        logger.warning("run %s: %s; skipping it for this epoch (on_shard_failure='skip')", self.id, message)
        self.history.append(history_row(epoch, shard, self.attempts[(epoch, shard)] - 1,
                                        reason=f"skipped: {message}", time=self._now()))
        skipped = self.skipped.setdefault(epoch, set())
        skipped.add(shard)
        self._set_shard(epoch, shard, "skipped")
        if len(self.merged.get(epoch, ())) + len(skipped) == self.spec.shards.n_shards:
            self.epoch_end[epoch] = (self.state.step, self._now())
            if self.spec.validation is None or self.state.version_step in self.validations:
                self._close_epochs()
            elif self.state.committed:
                self._submit_validation()
            else:  # the epoch's end version must exist to be validated
                await self._in_thread(self.state.commit)
                self._submit_validation()

    def _on_validation(self, rec: dict) -> None:
        self.validations[rec["step"]] = rec["metrics"]
        self._event("validation", step=rec["step"], metrics=rec["metrics"])
        self._close_epochs()

    def _close_epochs(self) -> None:
        """Record every epoch whose shards are all merged (and whose end version is validated)."""
        while True:
            epoch = len(self.epochs) + 1
            if epoch not in self.epoch_end:
                return
            end_step, wall = self.epoch_end[epoch]
            if self.spec.validation is not None and end_step not in self.validations:
                return
            merges = [h for h in self.history if h["epoch"] == epoch and h["accepted"]]
            row = {"epoch": epoch, "version": end_step, "wall_time": wall,
                   "train_loss": _mean([h["train_loss"] for h in merges]),
                   "skipped": len(self.skipped.get(epoch, ()))}
            if self.spec.validation is not None:
                # the band: every validated version that merged one of this epoch's updates
                end = self.validations[end_step]
                seen = [self.validations[h["new_version"]] for h in merges if h["new_version"] in self.validations]
                seen = seen or [end]
                for name in end:
                    values = [m[name] for m in seen]
                    row[name] = end[name]
                    row[f"{name}_mean"] = _mean(values)
                    row[f"{name}_min"] = min(values)
                    row[f"{name}_max"] = max(values)
            self.epochs.append(row)
            self._event("epoch", **row)
            target = self.spec.target
            if target and all(_reached(name, goal, row.get(name)) for name, goal in target.items()):
                self.stopping = f"target {target} reached at epoch {epoch}"

    async def _task_failed(self, task: TaskRecord, exc: BaseException, future) -> None:
        from distributed.scheduler import KilledWorker

        if isinstance(exc, StoreError) and not isinstance(exc, (StoreNotFoundError, StoreAccessDeniedError)):
            self._store_fault(task, exc)
            return
        if task.kind == "update" and isinstance(exc, (KilledWorker, OSError)):
            # Dask already retried it on other workers (allowed-failures); each loss is a worker failure
            for address in _suspects(exc) if task.started is not None else ():
                # only a task that was running counts against its worker; queued ones were collateral
                self._worker(address).failed += 1
                self._maybe_exclude(address)
                self._event("lost", epoch=task.epoch, shard=task.shard, worker=address,
                            worker_row=self._worker(address).as_row(), why=f"{type(exc).__name__}")
            self.history.append(history_row(task.epoch, task.shard, task.attempt, base_version=task.step,
                                            reason=f"lost: {type(exc).__name__}: {exc}", time=self._now()))
            if task.shard not in self.merged.get(task.epoch, ()):
                # A task that never started was only queued on the dead worker: not its fault.
                await self._retry_or_give_up(task.epoch, task.shard, f"{type(exc).__name__}",
                                             count=task.started is not None)
            return
        if task.kind == "validation" and isinstance(exc, (KilledWorker, OSError)):
            # an epoch may be waiting for these numbers; a validation dies mostly as collateral of a
            # shard that killed its worker, so it gets more attempts than a shard does
            if task.attempt + 1 < max(10, self.res.max_attempts):
                self._submit_validation(task.version, task.step, retry=task.attempt + 1)
                return
        raise RuntimeError(f"{task.kind} task (epoch {task.epoch}, shard {task.shard}) failed: {exc!r}") from exc

    def _store_fault(self, task: TaskRecord, exc: BaseException) -> None:
        """A task failed because the store (parameters or data) did not answer: not the worker's fault,
        not the shard's.  Its work goes back to wait; dispatch holds off with backoff, and the run
        fails only once the store has been out longer than ``store_outage_timeout``."""
        if self.outage.fault(exc):
            self._event("paused", cause="store", why=str(exc))
            logger.warning("run %s paused: a task could not reach the store: %s", self.id, exc)
        if task.kind == "update":
            self.history.append(history_row(task.epoch, task.shard, task.attempt, base_version=task.step,
                                            worker=task.worker, reason=f"store fault: {exc}", time=self._now()))
            if task.shard not in self.merged.get(task.epoch, ()) and not self._copy_running(task.epoch, task.shard):
                self.returned.append((task.epoch, task.shard))
        else:
            self.parked_validations.append((task.version, task.step, task.attempt + 1))

    def _store_back(self) -> None:
        """A task got through to the store: the outage (if any) is over."""
        lasted = self.outage.back()
        if lasted is not None:
            logger.warning("run %s: the store answers again after %.0f s; continuing", self.id, lasted)
            self._event("resumed", cause="store", after=lasted)

    def _copy_running(self, epoch: int, shard: int) -> bool:
        return any(t.kind == "update" and (t.epoch, t.shard) == (epoch, shard) and not t.overdue
                   for t in self.in_flight.values())

    # -- the end ------------------------------------------------------------------------------
    async def _finish(self) -> None:
        leftover = [k for k, t in self.in_flight.items() if t.kind == "update"]
        if leftover:
            await self.client.cancel([self.futures[k] for k in leftover])
            for key in leftover:
                task = self.in_flight.pop(key)
                self.futures.pop(key, None)
                self.history.append(history_row(task.epoch, task.shard, task.attempt, base_version=task.step,
                                                reason=f"cancelled: {self.stopping or 'run finished'}",
                                                time=self._now()))
        await self._in_thread(self.state.commit)
        version, step = self.state.head
        if self.spec.validation is not None and step not in self.validations:
            await self._final_validation(version, step)
        await self._in_thread(self._drop_leftover_updates)
        self.status = "finished"
        self._event("finished", version=version, step=step, reason=self.stopping or "max_epochs")

    async def _final_validation(self, version: str, step: int) -> None:
        for attempt in range(1000):
            future = self.client.submit(validate_version, self.store, self.id, version, step,
                                        key=f"vcdask-validate-{self.id}-final-{attempt}", priority=10)
            try:
                rec = await self._result(future)
            except StoreError as exc:  # wait for the store, within store_outage_timeout
                self._store_fault(TaskRecord("validation", step=step, version=version, attempt=attempt), exc)
                self.parked_validations.clear()
                await asyncio.sleep(self.outage.wait_seconds())
                continue
            self._store_back()
            self.validations[rec["step"]] = rec["metrics"]
            return

    def _drop_leftover_updates(self) -> None:
        if self.spec.keep_updates:
            return
        try:
            for path in self.store.files.list(f"{self.id}/updates"):
                self.store.files.delete(path)
        except OSError as e:  # best effort: the run's result does not depend on it
            logger.warning("run %s: could not remove its leftover update objects: %s", self.id, e)

    async def _cleanup(self) -> None:
        if self.client is not None:
            try:
                await self.client.cancel(list(self.futures.values()))
                await self.client.close()
            except Exception:  # noqa: BLE001 - closing after a failure; the failure is already recorded
                logger.debug("closing the client of run %s", self.id, exc_info=True)
        self.executor.shutdown(wait=False)

    # -- views --------------------------------------------------------------------------------
    def status_dict(self) -> dict:
        last = self.epochs[-1] if self.epochs else {}
        return {"run_id": self.id, "status": self.status, "error": self.error, "step": self.state.step,
                "version": self.state.version, "epochs_done": len(self.epochs), "max_epochs": self.spec.max_epochs,
                "n_shards": self.spec.shards.n_shards,
                "merged_in_epoch": len(self.merged.get(len(self.epochs) + 1, ())),
                "in_flight": self._n_training(), "last_epoch": last, "stopping": self.stopping,
                "paused": self.state.stalled() or self.outage.why or self.no_workers, "tasks": self._task_table(),
                "elapsed": time.time() - self.started, "alpha": self._alpha_now(),
                "staleness": next((h["staleness"] for h in reversed(self.history) if h["accepted"]), None),
                "store": self.store.location, "branch": self.spec.branch,
                "merge": getattr(self.spec.merge, "name", None)}

    def _alpha_now(self) -> float | None:
        try:
            schedule = getattr(self.spec.merge, "schedule", None)
            return None if schedule is None else float(schedule(max(1, self.dispatch_epoch)))
        except Exception:  # noqa: BLE001 - a user's schedule; the panel shows nothing rather than fail
            return None

    def panel_state(self, recent_epochs: int = 50) -> dict:
        """Everything the progress panel shows, for a panel that starts (or re-attaches) mid-run;
        events keep it current from there."""
        first = max(1, self.dispatch_epoch - recent_epochs + 1)
        metrics = list(self.spec.metrics) or ["loss"]
        return {"status": self.status_dict(), "epochs": list(self.epochs),
                "workers": [w.as_row() for w in self.workers.values()],
                "shards": [[e, s, st] for (e, s), st in self.shard_state.items() if e >= first],
                "metric": metrics[0] if self.spec.validation is not None else "train_loss"}

    def _task_table(self) -> list[dict]:
        """Shard tasks in flight: where they run and what state Dask has them in."""
        rows = []
        for key, t in self.in_flight.items():
            if t.kind != "update":
                continue
            ts = self.scheduler.tasks.get(key)
            rows.append({"epoch": t.epoch, "shard": t.shard, "attempt": t.attempt, "overdue": t.overdue,
                         "started": t.started is not None, "worker": self._processing_on(key),
                         "state": ts.state if ts is not None else "forgotten"})
        return rows

    def result_dict(self) -> dict:
        return {**self.status_dict(), "history": self.history, "epochs": self.epochs,
                "workers": [w.as_row() for w in self.workers.values()],
                "final_metrics": self.validations.get(self.state.version_step), "branch": self.spec.branch}


_ACTIVE = ("queued", "running", "re-issued")


async def _await(future):
    return await future


def _suspects(exc: BaseException) -> list[str]:
    """Worker addresses a KilledWorker names (the last one that died running the task)."""
    worker = getattr(exc, "last_worker", None)
    address = getattr(worker, "address", worker)
    return [address] if isinstance(address, str) else []


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def _reached(name: str, goal: float, value: float | None) -> bool:
    if value is None:
        return False
    return value <= goal if name == "loss" or name.endswith("error") or name in ("mse", "mae") else value >= goal
