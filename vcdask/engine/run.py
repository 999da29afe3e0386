"""One training run on a scheduler: the run's shell, the only part of a run that awaits.

The run's decisions are its core's (:mod:`vcdask.engine.core`: one :class:`~.core.RunState`, events in,
effects out, no I/O).  The shell feeds it events (what Dask, the tasks, the merge thread, the clock and
the plugin's handlers report) and carries out the effects it returns, in order: it submits and cancels
tasks through :class:`~.inflight.InFlight`, reads their records back (:mod:`.results`), and calls into
the merge thread through :class:`~.lane.MergeLane` (merges, commits, deletes), whose outcomes go back to
the core as events.  It answers the tasks that ask for their base (:class:`~.handshake.Bases`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..spec import RunSpec
from ..store._runs import check_staged
from ..updates import delete_run_updates, delete_update, update_gone
from ..worker import train_shard, validate_version
from . import end, results, views
from .core import Phase, RunFailed, RunState, handle
from .core import messages as m
from .core.watching import still_running
from .events import EventLog
from .handshake import Bases, Handshake
from .inflight import InFlight
from .lane import MergeLane, server_for
from .recovery import recover

logger = logging.getLogger(__name__)

__all__ = ["Run"]

#: Seconds between the deadline watchdog's looks, and the idle driver's.
INTERVAL = 0.2
#: How often a preempted worker's kept copies are looked at (seconds).
SETTLE_POLL = 0.05
#: At most how often the run's record is written again as epochs close (seconds): each write holds every epoch row.
RECORD_INTERVAL = 5.0
#: What each kind of task runs on its worker.
_TASKS: dict[str, Callable[..., Any]] = {"update": train_shard, "validation": validate_version}


class Run:
    """One training run on a scheduler (see :mod:`vcdask.engine.plugin` for how clients reach it)."""

    def __init__(self, scheduler: Any, spec: RunSpec, resume: bool = False):
        self.scheduler, self.spec, self.resume = scheduler, spec, resume
        self.store, self.id = spec.store, spec.run_id
        self.done = asyncio.Event()
        self.events = EventLog(scheduler, self.id)
        self.server = server_for(spec)
        self.lane = MergeLane(self.server, f"vcdask-merge-{self.id[-6:]}")  # the merge thread and its calls
        self.tasks = InFlight(scheduler)
        self.state = RunState(spec, {a: ws.nthreads for a, ws in scheduler.workers.items()}, tasks=self.tasks)
        self.handshake = Handshake(self.state)  # the results taken and settled, and the tasks waiting for them
        self.bases = Bases(self.state, self.handshake, lambda: self.lane.head, self.server.commit_every, self.done)
        self._handed_any = asyncio.Event()  # set when a record is handed over (self.tasks.handed)
        self._background: set[asyncio.Future[Any]] = set()  # effects step_now carries out meanwhile
        self._epochs_recorded, self._recorded_at = 0, -RECORD_INTERVAL  # the run's record: its epochs, when

    # -- what the plugin reads --------------------------------------------------------------------
    @property
    def status(self) -> str:
        return self.state.phase.value

    def status_dict(self) -> dict[str, Any]:
        return views.status_dict(self._fresh(), self.server.stalled())

    def panel_state(self) -> dict[str, Any]:
        return views.panel_state(self._fresh(), self.server.stalled())

    def result_dict(self) -> dict[str, Any]:
        return self.state.final or views.result_dict(self._fresh(), self.server.stalled())

    def _fresh(self) -> RunState:
        self.state.head = self.lane.head
        return self.state

    # -- the core's events and effects --------------------------------------------------------------
    async def step(self, event: m.Event) -> Any:
        """Hand ``event`` to the core and carry out its effects, in order; the core's reply, if any."""
        return await self._apply(handle(self._fresh(), event))

    def step_now(self, event: m.Event) -> Any:
        """:meth:`step` for a caller that cannot wait: effects that await are carried out in the background
        (a failure among them ends the run through its driver, which checks :attr:`RunState.failure`)."""
        reply, later = None, list[m.Effect]()
        for fx in handle(self._fresh(), event):
            if isinstance(fx, m.Reply):
                reply = fx.value
            elif not isinstance(fx, m.Fail) and not self._at_once(fx):
                later.append(fx)
        if later:
            task = asyncio.ensure_future(self._apply(later))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        self.handshake.note_settled()
        return reply

    async def _apply(self, effects: list[m.Effect]) -> Any:
        reply = None
        for fx in effects:
            if isinstance(fx, m.Reply):
                reply = fx.value
            elif self._at_once(fx):
                pass
            elif isinstance(fx, m.Cancel):
                await self.tasks.cancel(fx.keys)
            elif isinstance(fx, m.Read):
                await self._read(fx)
            elif isinstance(fx, m.Merge):
                await self._merge(fx)
            elif isinstance(fx, m.Commit):
                await self.lane.commit()
                await self.step(m.Committed(self.lane.head))
            elif isinstance(fx, m.DropUpdate):
                await self.lane.call(delete_update, self.store.files, fx.path)
            elif isinstance(fx, m.Skip):  # (in the run's progress, for its next commit)
                await self.lane.call(self.server.note_skip, fx.epoch, fx.shard, fx.end_step)
            elif isinstance(fx, m.Fail):
                raise RunFailed(fx.failure)
            else:  # pragma: no cover - a new effect the shell does not know yet
                raise TypeError(f"not an effect of a run's core: {fx!r}")
        self.handshake.note_settled()
        if (
            len(self.state.ledger.epochs) > self._epochs_recorded
            and time.monotonic() >= self._recorded_at + RECORD_INTERVAL
        ):
            await self._record_epochs()
        return reply

    async def _record_epochs(self) -> None:
        """Write the run's record with the epochs closed so far (a resume after a crash shows what they measured);
        at most every :data:`RECORD_INTERVAL` seconds."""
        self._epochs_recorded, self._recorded_at = len(self.state.ledger.epochs), time.monotonic()
        rec = end.running_record(self._fresh(), self.scheduler.address)
        await self.lane.write_record(self.store, self.id, lambda: rec)

    def _at_once(self, fx: m.Effect) -> bool:
        """Carry out ``fx`` if it needs no waiting (a submit, an event published); whether it did."""
        if isinstance(fx, m.Submit):
            self._submit(fx)
        elif isinstance(fx, m.Emit):
            self.events.emit(fx.kind, **fx.fields)
        else:
            return False
        return True

    def _submit(self, fx: m.Submit) -> None:
        try:
            self.tasks.send(
                _TASKS[fx.kind], self.store, self.id, *fx.args, key=fx.key, priority=fx.priority, **fx.where
            )
        except Exception:
            self.tasks.pop(fx.key)  # no task behind the core's record: it holds no slot, blocks no copy
            raise

    async def _read(self, fx: m.Read) -> None:
        future = self.tasks.futures.get(fx.key)
        if future is None:
            self.tasks.settled(fx.task)
            return
        try:
            got = await results.read(self.tasks, self.lane, self.store, self.id, future, fx.task, self._watch_pool)
        except RunFailed:
            raise  # the run's own verdict while it waited, not the task's failure
        except Exception as exc:  # noqa: BLE001 - a task's error is data for the failure policy
            await self.step(m.TaskFailed(fx.task, exc))
            return
        await self.step(m.Lost(fx.task, got) if isinstance(got, str) else m.Result(fx.task, got))

    async def _watch_pool(self) -> None:
        await self.step(m.Poll(fill=False))

    async def _merge(self, fx: m.Merge) -> None:
        outcome = await self.lane.merge(
            fx.record,
            completes=fx.completes,
            max_staleness=fx.max_staleness,
            more=self.tasks.results_waiting(),  # fold their commits
            in_use_step=fx.in_use_step,
            ahead=fx.ahead,
        )
        if outcome.pop("drafted", False):  # the tasks waiting for this merge start from its draft while it
            self.handshake.note_settled()  # is committed, before any other result is merged (a commit queued
            await self.lane.commit()  # meanwhile, by a skipped shard, may have done it already)
            outcome["version_id"] = self.lane.head.version
        await self.step(m.Merged(fx.task, fx.record, outcome, self.lane.head))

    # -- the driver -----------------------------------------------------------------------------
    async def drive(self) -> None:
        state = self.state
        watchdog = None
        try:
            await self.tasks.open(f"vcdask-{self.id}")
            if self.resume:  # rebuilt from its branch and folder (workers keep nothing of it: old spec, optimizers)
                await end.release_on_workers(self.scheduler, self.id, list(getattr(self.scheduler, "workers", ())))
                await recover(self.lane, self.store, self.spec, self.step)
            else:
                await self.lane.load()
            state.phase = Phase.RUNNING
            rec = end.running_record(self._fresh(), self.scheduler.address)
            await self.lane.write_record(self.store, self.id, lambda: rec, strict=True)
            if self.resume:  # a collection removed its staged data since resume() looked: its marker, written first
                await self.lane.call(check_staged, self.store.files, self.id)
            self.events.emit("started", version=self.lane.head.version, step=self.lane.head.step)
            watchdog = asyncio.ensure_future(self._deadlines())
            nxt = handed = None
            while not state.finished():
                if state.failure is not None:  # (failed by an event handled outside the driver)
                    raise RunFailed(state.failure)
                await self.step(m.Poll())
                if not self.tasks.records and not self.tasks.handed:
                    await self._settle_folded()  # nothing more will come soon: commit the merges folded so far
                    if watchdog.done():
                        watchdog.result()  # the deadline watchdog failed the run: raise it
                    await self.step(m.Idle())
                    await asyncio.sleep(INTERVAL)
                    continue
                if nxt is None and self.tasks.records:  # (each has its future in there until it is read)
                    nxt = asyncio.ensure_future(self.tasks.completed.__anext__())
                handed = handed or asyncio.ensure_future(self._handed_any.wait())
                # wake up now and then even if nothing completes: workers may have joined
                waits = {w for w in (nxt, handed, watchdog) if w is not None}
                await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if watchdog.done():
                    watchdog.result()  # the deadline watchdog failed the run (e.g. on_shard_failure="stop"): raise it
                if self.tasks.handed:
                    task, record = self.tasks.handed.popleft()
                    await self.step(m.Result(task, record, taken=True))
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
            await self._finish()
        except asyncio.CancelledError:  # (its scheduler closes: recorded as such, to be resumed)
            end.cut_off(state)
            raise
        except RunFailed as failed:
            self._failed(str(failed.failure))
        except Exception:  # noqa: BLE001 - the run's error is recorded and published, not swallowed
            self._failed(traceback.format_exc())
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await self._release()  # its record written; W_s and the model dropped
            self.done.set()

    def _failed(self, error: str) -> None:
        self.state.phase, self.state.error = Phase.ERROR, error
        logger.error("vcdask run %s failed:\n%s", self.id, error)
        self.events.emit("failed", error=error)

    async def _deadlines(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL)
            await self.step(m.Tick(self.tasks.workers_seen()))  # (paused workers, free threads: no hook says)

    async def _settle_folded(self) -> None:
        if self.lane.head.folded and not self.tasks.results_waiting():  # the queue ran dry: commit the folded merges
            await self.lane.commit()
        self.handshake.note_settled()

    async def _on_done(self, future: Any) -> None:
        try:
            await self.step(m.Completed(future.key, cancelled=future.status == "cancelled"))
        finally:
            self.tasks.forget(future.key)
            future.release()

    # -- the end ----------------------------------------------------------------------------------
    async def _finish(self) -> None:
        """Cancel the copies still out (and the results handed over but not merged), commit what is
        merged, validate the head, drop the run's updates (unless kept) and apply its retention once more."""
        await self.step(m.Finish())
        await self.lane.commit()
        head = self.lane.head
        if self.spec.validation is not None and head.step not in self.state.ledger.validations:
            await results.validate_head(self.state, self.tasks, self.step, head.version, head.step)
        await self.lane.drain()  # (the merged updates' deletes: before the rest is dropped)
        if update_gone("run ended", self.spec.keep_updates):
            await self.lane.call(delete_run_updates, self.store.files, self.id)
        await self.lane.collect(final=True, in_use_step=self._fresh().in_use_step())  # the retention, once more
        self.state.phase = Phase.CANCELLED if self.state.cancelled else Phase.FINISHED
        self.events.emit("finished", version=head.version, step=head.step, reason=self.state.stopping or "max_epochs")

    async def _release(self) -> None:
        """After the run ended: close its client, write its record, keep its small result dict and drop
        ``W_s``, the rule's state, the bases and the spec's model."""
        try:
            await self.tasks.close()
        except Exception:
            logger.debug("closing the client of run %s", self.id, exc_info=True)
        state = self._fresh()
        state.ended = time.time()
        state.pool.stop_clocks()  # (its workers' time, and cost, stop with the run: its status says so later)
        state.final = final = views.result_dict(state, self.server.stalled())
        await self.lane.write_record(self.store, self.id, lambda: end.record(state, final))  # (lists versions)
        await self.lane.call(end.sweep_staged_data, self.store, self.id)  # (other runs': their time may be up)
        self.lane.shutdown()
        self.server.release()
        self.spec = state.spec = end.let_go_of_inputs(self.spec)
        await end.release_on_workers(self.scheduler, self.id, list(state.pool.records))  # (on their GPUs)

    # -- what the plugin's handlers and hooks call -------------------------------------------------
    def hand_over(self, key: str, record: dict[str, Any]) -> str | None:
        """A task's record, sent by the task as it finishes, a round trip sooner than Dask's report (see
        :func:`.core.arrivals.hand_over`): its worker gets its next shard now, even while the driver merges.

        Returns the key of the shard copy sent to the task's worker to run next (placed there), if
        any: its base can travel back with the hand-over's answer (:meth:`next_base`).
        """
        before = len(self.tasks.handed)
        try:
            sent = self.step_now(m.HandOver(key, record)) or []
        except Exception:  # the driver fills the free slot on its next pass
            logger.warning("run %s: sending a worker its next shard failed", self.id, exc_info=True)
            sent = []
        if len(self.tasks.handed) > before:
            self._handed_any.set()
        worker = record.get("worker")
        return next((k for k in sent if getattr(self.tasks.records.get(k), "placed", None) == worker), None)

    async def base_for(self, key: str, worker: str | None = None) -> dict[str, Any] | None:
        return await self.bases.base_for(key, worker)

    async def next_base(self, key: str, worker: str) -> dict[str, Any] | None:
        return await self.bases.next_base(key, worker)

    def task_started(
        self, key: str, worker: str, instance: str | None = None, market: str | None = None, handed: bool = False
    ) -> None:
        self.step_now(m.Started(key, worker, instance, market, handed))

    def joined(self, worker: str, nthreads: int) -> None:
        self.step_now(m.Joined(worker, nthreads))

    def left(self, worker: str) -> None:
        self.step_now(m.Left(worker))

    async def stop(self, reason: str, cancel: bool = False) -> None:
        """Stop dispatching and cancel the shards in flight; the driver then commits and finishes (with
        ``cancel``: as "cancelled", a run without a result)."""
        if not self.done.is_set():
            await self.step(m.Stop(reason, cancel))

    def reissue(self, epoch: int, shard: int) -> str | None:
        """Train (epoch, shard) once more from the current version; the first valid result wins.  The new
        copy's key, or None when no worker is usable now (the copy is sent once one is)."""
        if self.tasks.completed is None or self.done.is_set():
            raise RuntimeError(f"run {self.id} is not running")
        return self.step_now(m.Reissue(epoch, shard))

    def preempt(self, worker: str, window: float | None = None) -> tuple[list[str], list[str]]:
        """A notice that ``worker`` will be reclaimed in ``window`` seconds: ``(re-issued keys, kept keys)``
        (see :mod:`vcdask.engine.core.watching`)."""
        return self.step_now(m.Preempt(worker, window))

    async def settle(self, worker: str, kept: list[str], deadline: float) -> list[str]:
        """Wait until none of the ``kept`` copies runs on ``worker`` any more, or until ``deadline``
        (``time.monotonic()``); then re-issue the ones still running there.  Returns their new keys."""
        left = list(kept)
        while left and not self.done.is_set():
            left = still_running(self.state, worker, tuple(left))
            if not left or time.monotonic() >= deadline:
                break
            await asyncio.sleep(SETTLE_POLL)
        return self.step_now(m.Settle(worker, tuple(left))) if left else []
