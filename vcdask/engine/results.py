"""Reading a finished task's record back: from the worker that holds it, or from the store.

A shard task writes its update, with its record, to the store before it returns, so a record
whose worker died or froze after finishing is not lost with that worker.  Dask would run such a
task again (its result is gone) and the run, reading results one at a time, would wait for that
rerun: the whole run held up by one worker.  Instead the run reads the record from the store
(:func:`read`) and cancels the Dask task; a record the store does not have either is a lost
copy, re-issued by the run like any other.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..updates import read_update_meta, update_path
from ..worker import validate_version
from .core import messages as m
from .core.dispatching import validation_deadline, validation_placement
from .events import final_validate_key
from .inflight import TaskRecord

if TYPE_CHECKING:
    from .core import RunState
    from .inflight import InFlight
    from .lane import MergeLane

__all__ = ["PATIENCE", "fetch", "read", "validate_final", "validate_head"]

logger = logging.getLogger(__name__)

#: Seconds the run waits for a finished task's record from the worker holding it (a few
#: milliseconds when that worker answers) before it reads the record from the store instead.
PATIENCE = 5.0
#: Seconds between looks at the scheduler while the run waits for a record.
POLL = 0.25


async def read(
    tasks: InFlight,
    lane: MergeLane,
    store: Any,
    run_id: str,
    future: Any,
    task: TaskRecord,
    watch: Callable[[], Awaitable[None]],
) -> dict[str, Any] | str:
    """The record of the finished task ``future`` (``task`` is the run's record of it), or why it
    cannot be had (its worker is gone or does not answer, and the store has no copy of it): the
    run's core then records the copy as lost and re-issues its shard, or validates again.  A task's
    own error is raised, for the failure policy; ``watch`` is awaited now and then while the run waits.
    """
    got = await fetch(tasks, future, watch)
    if not isinstance(got, str) and got.get("kind") != "abandoned":
        return got
    why = got if isinstance(got, str) else "the copy gave up: the run no longer waited for it"
    record = await lane.call(stored_record, store, run_id, task) if task.kind == "update" else None
    if record is not None:
        logger.warning(
            "run %s: read the result of epoch %d shard %d attempt %d from the store (%s)",
            run_id,
            task.epoch,
            task.shard,
            task.attempt,
            why,
        )
        return record
    logger.warning("run %s: the result of %s task %s is lost (%s)", run_id, task.kind, future.key, why)
    return why


async def fetch(tasks: InFlight, future: Any, watch: Callable[[], Awaitable[None]]) -> dict[str, Any] | str:
    """The result of the finished task ``future`` from the worker holding it; or, when that worker
    left or did not hand it over within :data:`PATIENCE`, why not (the task is then cancelled: no
    rerun of a finished task; its work is in the store, or the run runs it afresh).  A task's own
    error is raised; ``watch`` is awaited between looks (a run waiting here still watches its pool)."""
    task = asyncio.ensure_future(_await(future))
    since = time.monotonic()
    gone = False
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL)
            if done:
                return task.result()
            await watch()
            # the key leaves "memory" when the only worker holding the result leaves: Dask would run it again
            gone = tasks.state(future.key) not in ("memory", "erred")
            if gone or time.monotonic() - since > PATIENCE:
                break
    finally:
        task.cancel()
    await tasks.client.cancel([future])
    return "its worker left" if gone else f"its worker did not hand it over in {PATIENCE:g} s"


def stored_record(store: Any, run_id: str, task: TaskRecord) -> dict[str, Any] | None:
    """The record a shard task stored with its update (the run's merge thread), or None."""
    path = update_path(run_id, task.epoch, task.shard, task.attempt)
    try:
        meta = read_update_meta(store.files, path)
    except FileNotFoundError:
        return None
    except Exception:  # a store that does not answer now: the copy is re-issued instead
        logger.warning("run %s: reading %s back failed", run_id, path, exc_info=True)
        return None
    if not meta:
        return None
    # the run's own clock for what the worker's record would have said (it is written before the upload)
    seconds = time.monotonic() - (task.started or task.submitted)
    return {"seconds": seconds, "upload_seconds": math.nan, **meta}


async def _await(future: Any) -> Any:
    return await future


async def _run_then_fetch(tasks: InFlight, future: Any, watch: Callable[[], Awaitable[None]]) -> dict[str, Any] | str:
    """:func:`fetch` for a task just sent: first wait until it has finished (or erred; a worker that
    dies running it leaves it to Dask, which runs it elsewhere), then read its result.  (:func:`fetch`
    on a task still running took it for one whose worker left with its result: a final validation
    that took longer than :data:`POLL` was cancelled and sent again, until the run failed.)"""
    while not future.done() and tasks.state(future.key) not in ("memory", "erred"):
        await asyncio.sleep(POLL)
        await watch()
    return await fetch(tasks, future, watch)


async def validate_final(
    tasks: InFlight,
    store: Any,
    run_id: str,
    version: str | None,
    step: int,
    *,
    placement: Callable[[set[str]], dict[str, Any] | None],
    deadline: Callable[[], float],
    watch: Callable[[], Awaitable[None]],
    store_fault: Callable[[TaskRecord, BaseException], Awaitable[float]],
    give_up: Callable[[], str | None] = lambda: None,
) -> dict[str, Any] | str:
    """The final version's validation record, waiting through store outages (``store_fault`` tells the
    run's core and says how long to hold off; past ``store_outage_timeout`` the core fails the run), and
    validating it again elsewhere when an attempt is late (``deadline()``, twice over: the attempt may
    wait for a worker to start it) or lost with its worker.  ``placement(avoid)``: where it may run.
    ``give_up()``, asked while it waits, says why the run should end without the validation (a run asked
    to stop, with no worker left to run it): that reason is returned."""
    avoid: set[str] = set()
    for attempt in range(1000):
        if (why := give_up()) is not None:
            return why
        future = tasks.client.submit(
            validate_version,
            store,
            run_id,
            version,
            step,
            key=final_validate_key(run_id, attempt),
            priority=10,
            **(placement(avoid) or {}),
        )
        try:
            rec = await _validation(tasks, future, watch, deadline(), give_up)
        except _Late:
            on = tasks.processing_on(future.key)
            logger.warning(
                "run %s: the final validation did not come back from %s within %.1f s; validating it elsewhere",
                run_id,
                on or "the scheduler's queue",
                2 * deadline(),
            )
            avoid |= {on} if on else set()
            await tasks.client.cancel([future])  # (its slot is the next attempt's)
            continue
        except _GaveUp as e:
            await tasks.client.cancel([future])
            return str(e)
        except StoreError as exc:
            task = TaskRecord("validation", step=step, version=version, attempt=attempt)
            await asyncio.sleep(await store_fault(task, exc))
            continue
        if isinstance(rec, str):  # lost with its worker: run it again
            logger.warning("run %s: the final validation's result is lost (%s); running it again", run_id, rec)
            continue
        return rec
    raise RuntimeError(f"run {run_id}: the final validation of version {version} failed 1000 times")


class _Late(Exception):
    """A final validation ran past twice its deadline."""


class _GaveUp(Exception):
    """The run ends without its final validation (the reason)."""


async def _validation(
    tasks: InFlight,
    future: Any,
    watch: Callable[[], Awaitable[None]],
    deadline: float,
    give_up: Callable[[], str | None],
) -> dict[str, Any] | str:
    """:func:`_run_then_fetch` of a final validation just sent: :class:`_Late` past twice ``deadline``,
    :class:`_GaveUp` once ``give_up()`` says so."""
    late = time.monotonic() + 2 * deadline

    async def look() -> None:
        await watch()
        if (why := give_up()) is not None:
            raise _GaveUp(why)
        if time.monotonic() > late:
            raise _Late

    return await _run_then_fetch(tasks, future, look)


async def validate_head(
    state: RunState, tasks: InFlight, step: Callable[[m.Event], Awaitable[Any]], version: str | None, at: int
) -> None:
    """Validate a run's final version (:func:`validate_final`) and hand its numbers to the run's core with
    ``step`` (the shell's :meth:`~vcdask.engine.run.Run.step`); ``at``: the version's step."""
    spec = state.spec

    async def store_fault(task: TaskRecord, exc: BaseException) -> float:
        await step(m.StoreFault(task, exc))
        state.dispatch.parked_validations.clear()
        return state.outage.wait_seconds()

    def give_up() -> str | None:  # a run asked to stop does not wait for a worker to join
        if state.asked_to_stop and not state.pool.usable():
            return "it was asked to stop, and no usable worker is connected to validate it"
        return None

    async def watch() -> None:
        await step(m.Poll(fill=False))

    rec = await validate_final(
        tasks,
        spec.store,
        spec.run_id,
        version,
        at,
        placement=lambda avoid: validation_placement(state, avoid),
        deadline=lambda: validation_deadline(state),
        watch=watch,
        store_fault=store_fault,
        give_up=give_up,
    )
    await step(m.StoreBack())
    if isinstance(rec, str):
        logger.warning("run %s: ends without validating its final version %s: %s", spec.run_id, version, rec)
        return
    await step(m.Validated(rec["step"], rec["metrics"]))
