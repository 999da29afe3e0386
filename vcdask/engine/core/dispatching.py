"""Handing work out: shard copies to the free slots, validations of the versions due.

Functions of the :class:`~.state.RunState`; a task sent is a :class:`~.messages.Submit` effect, its
record in the task table from then on.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .. import policy
from ..events import train_key, validate_key
from ..inflight import TaskRecord
from .messages import Submit
from .state import RunState

__all__ = ["fill", "submit_shard", "submit_validation", "validation_deadline", "validation_placement", "wake"]


def fill(state: RunState, freed_worker: str | None = None) -> list[str]:
    """Hand out shards until every slot is busy (parked work first); the keys of the shard copies sent."""
    sent: list[str | None] = []
    if state.outage.holding():
        return []  # the store is out
    if not state.pool.usable():
        return wake(state)  # nobody to run on: wait for workers to (re)join
    dispatch = state.dispatch
    parked, dispatch.parked_validations = dispatch.parked_validations, []
    for version, step, retry in parked:
        submit_validation(state, version, step, retry)
    while state.stopping is None and state.tasks.training() < state.pool.slots():
        if dispatch.returned:
            epoch, shard = dispatch.returned.pop(0)
            if not state.ledger.is_merged(epoch, shard) and not state.tasks.copy_running(epoch, shard):
                sent.append(submit_shard(state, epoch, shard))
            continue
        nxt = dispatch.next_shard(freed_worker)
        if nxt is None:
            break
        sent.append(submit_shard(state, *nxt))
        freed_worker = None
    return [key for key in sent if key is not None]


def wake(state: RunState) -> list[str]:
    """With no worker connected at all, and no shard copy out, one copy goes to the scheduler unrestricted:
    an adaptive cluster scaled to zero (``cluster.adapt(minimum=0)``, a spot fleet's default) starts
    workers only for tasks it holds, and every copy parked here would leave it at zero until the run
    gave up (``no_worker_timeout``).  With workers connected but none usable (all excluded or draining)
    nothing goes out: such a copy could go to one of them."""
    if state.pool.connected or state.stopping is not None or state.tasks.training():
        return []
    dispatch = state.dispatch
    nxt = dispatch.returned.pop(0) if dispatch.returned else dispatch.next_shard()
    if nxt is None:
        return []
    key = submit_shard(state, *nxt, anywhere=True)
    return [key] if key is not None else []


def submit_shard(
    state: RunState, epoch: int, shard: int, avoid: str | Collection[str] | None = None, anywhere: bool = False
) -> str | None:
    """Send a copy of (epoch, shard) to train from the newest version; its key.  None when no worker
    is usable: the shard is parked and sent first once one is (:func:`fill`).  ``anywhere``: unrestricted,
    with no worker to place it on (:func:`wake`)."""
    avoided = state.stuck_workers() | ({avoid} if isinstance(avoid, str) else set(avoid or ()))
    dispatch, pool = state.dispatch, state.pool
    where = (
        {}
        if anywhere
        else dispatch.placement(
            dispatch.home.get(shard), pool.usable(), len(pool.connected), avoided, state.busy_workers()
        )
    )
    if where is None:
        dispatch.park(epoch, shard)
        return None
    attempt = dispatch.next_attempt(epoch, shard)
    head = state.head
    placed = where.get("workers", ())
    key = train_key(state.id, epoch, shard, attempt)
    task = TaskRecord(
        "update",
        epoch,
        shard,
        attempt,
        head.version_step,
        submitted=state.clock(),
        placed=placed[0] if len(placed) == 1 else None,
    )
    state.tasks.add(key, task)
    args = (epoch, shard, attempt, head.version, head.version_step, dispatch.position(epoch, shard))
    state.out.append(Submit(key, "update", args, where))
    state.ledger.set_shard(epoch, shard, "queued" if attempt == 0 else "re-issued")
    return key


def submit_validation(
    state: RunState, version: str | None = None, step: int | None = None, retry: int = 0, avoid: set[str] | None = None
) -> None:
    """Validate ``version`` (default: the newest committed one), once; on a usable worker, away from
    stuck ones and ``avoid`` (:func:`validation_placement`), or parked until one is usable."""
    if version is None or step is None:
        version, step = state.head.version, state.head.version_step
    key = validate_key(state.id, step, retry)
    if key in state.tasks.records or step in state.ledger.validations or state.tasks.validating(step):
        return
    where = validation_placement(state, avoid or set())
    if where is None:
        state.dispatch.parked_validations.append((version, step, retry))
        return
    task = TaskRecord("validation", attempt=retry, step=step, version=version, submitted=state.clock())
    state.tasks.add(key, task)
    state.out.append(Submit(key, "validation", (version, step), where, priority=10))


def validation_placement(state: RunState, avoid: Collection[str] = frozenset()) -> dict[str, Any] | None:
    """Dask placement for a validation task: any usable worker (not excluded, not draining), away from
    the stuck ones and ``avoid`` unless no other is usable; None when no worker is usable (the run
    parks the validation until one is)."""
    avoided = state.stuck_workers() | set(avoid)
    return state.dispatch.placement(None, state.pool.usable(), len(state.pool.connected), avoided)


def validation_deadline(state: RunState, worker: str | None = None) -> float:
    """Seconds a validation may run: the shard copies' rule (:func:`~vcdask.engine.policy.deadline`)
    applied to the run's measured validation times (the shards' times until a validation has come
    back), one task per slot; the cold-worker floor on a worker that has finished no shard of the run
    yet.  A deadline too short costs a second validation, never a result: the late one is kept."""
    measured = state.ledger.validation_seconds or state.ledger.shard_seconds
    return policy.deadline(state.res, measured, 1, cold=state.pool.cold(worker))
