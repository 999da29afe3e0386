"""A run's core: one state, events in, effects out, no I/O.

:func:`handle` takes the run's :class:`~.state.RunState` and one event (:mod:`.messages`), changes the
state and returns the effects for the run's shell (:mod:`vcdask.engine.run`) to carry out, in order:
tasks to submit or cancel, a merge or a commit for the merge thread, an update to delete, events to
publish, the run to fail.  The decisions it makes are :mod:`~vcdask.engine.policy`'s; its handlers:
:mod:`.arrivals` (records and merges), :mod:`.failures` (what goes wrong), :mod:`.watching` (deadlines,
the pool, preemption notices), :mod:`.dispatching` (what goes out).  Tests drive it with scripted event
sequences, no cluster (``tests/test_engine_core.py``).
"""

from __future__ import annotations

from functools import singledispatch

from . import messages as m
from .arrivals import arrived, completed, hand_over, merged, taken
from .dispatching import fill, submit_shard, submit_validation
from .failures import close_epochs, lost, store_back, store_fault, task_failed
from .messages import Failure, RunFailed
from .state import Phase, RunState
from .watching import check_workers, deadlines, nothing_left, preempt, settle, started

__all__ = ["Failure", "Phase", "RunFailed", "RunState", "handle"]


def handle(state: RunState, event: m.Event) -> list[m.Effect]:
    """Apply ``event`` to ``state``; the effects to carry out, in order (nothing after a
    :class:`~.messages.Fail` is)."""
    state.out = []
    _on(event, state)
    out, state.out = state.out, []
    return out


@singledispatch
def _on(event: object, state: RunState) -> None:  # noqa: ARG001 - the handlers below take it
    raise TypeError(f"not an event of a run's core: {event!r}")


@_on.register
def _(event: m.Started, state: RunState) -> None:
    task = state.tasks.records.get(event.key)
    # a start recorded already on that worker stands (its clock runs from the first: with
    # ``overlap="delta"`` the answer that brings a copy's base may come before the task says it started),
    # unless the hand-over recorded it: the task's own start, later, is when it began
    if task is not None and (task.started is None or task.worker != event.worker or (task.handed and not event.handed)):
        began = task.started if task.began else None
        if task.kind == "update" and began is not None and not task.overdue and task.worker not in (None, event.worker):
            # Dask runs it again elsewhere: its worker died (or left) while running it.  (An overdue copy's
            # work was counted when it was re-issued; a copy the deadline check restarted has no start.)
            state.pool.lost(task.worker, state.clock() - began)
        started(state, event.key, event.worker)
        task.handed = event.handed
    state.pool.identify(event.worker, event.instance, event.market)


@_on.register
def _(_event: m.Idle, state: RunState) -> None:
    nothing_left(state)


@_on.register
def _(event: m.HandOver, state: RunState) -> None:
    state.out.append(m.Reply(hand_over(state, event.key, event.record)))


@_on.register
def _(event: m.Completed, state: RunState) -> None:
    completed(state, event.key, event.cancelled)


@_on.register
def _(event: m.Result, state: RunState) -> None:
    if not event.taken:
        taken(state, event.task, event.record)
    arrived(state, event.task, event.record)


@_on.register
def _(event: m.TaskFailed, state: RunState) -> None:
    state.tasks.settled(event.task)  # (its result never came: not a running copy any more)
    task_failed(state, event.task, event.error)


@_on.register
def _(event: m.Lost, state: RunState) -> None:
    state.tasks.settled(event.task)
    lost(state, event.task, event.why)


@_on.register
def _(event: m.Merged, state: RunState) -> None:
    state.head = event.head
    merged(state, event.task, event.record, event.outcome)


@_on.register
def _(event: m.Committed, state: RunState) -> None:
    state.head = event.head
    if not event.head.committed and (state.validate_committed or state.settle_on_commit):
        # a merge folded in after the commit (the driver's, while a deadline's give-up committed): once more
        state.out.append(m.Commit())
        return
    state.settled += state.settle_on_commit
    state.settle_on_commit = 0
    if state.validate_committed:
        state.validate_committed = False
        submit_validation(state)


@_on.register
def _(event: m.Tick, state: RunState) -> None:
    if event.workers is not None:
        state.pool.seen(event.workers)
    redundant = deadlines(state)
    if redundant and state.failure is None:  # (after the copies sent instead: a stop meanwhile cancels them)
        state.out.append(m.Cancel(tuple(redundant)))


@_on.register
def _(event: m.Poll, state: RunState) -> None:
    check_workers(state)
    if event.fill and state.failure is None:
        fill(state)


@_on.register
def _(event: m.Joined, state: RunState) -> None:
    state.pool.joined(event.worker, event.nthreads)


@_on.register
def _(event: m.Identified, state: RunState) -> None:
    state.pool.identify(event.worker, event.instance, event.market)


@_on.register
def _(event: m.Left, state: RunState) -> None:
    state.pool.left(event.worker)


@_on.register
def _(event: m.Preempt, state: RunState) -> None:
    state.out.append(m.Reply(preempt(state, event.worker, event.window)))


@_on.register
def _(event: m.Settle, state: RunState) -> None:
    state.out.append(m.Reply(settle(state, event.worker, event.kept)))


@_on.register
def _(event: m.Stop, state: RunState) -> None:
    """Stop dispatching and cancel the shards in flight; the driver then commits and finishes (with
    ``cancel``: as "cancelled", a run without a result)."""
    if state.phase in (Phase.STARTING, Phase.RUNNING) and state.stopping is None:
        state.stopping = event.reason
        state.cancelled = event.cancel
        state.asked_to_stop = True
        state.out.append(m.Cancel(tuple(k for k, _ in state.tasks.updates())))


@_on.register
def _(event: m.Reissue, state: RunState) -> None:
    state.out.append(m.Reply(submit_shard(state, event.epoch, event.shard)))


@_on.register
def _(event: m.Resumed, state: RunState) -> None:
    """Rebuild the run from what its store says (after the scheduler that drove it died): what was
    merged, the epochs that ended (their versions validated again), the attempt numbers used; the
    uploads no committed version holds are taken out of the queues (the shell merges them next)."""
    state.ledger.merged = event.merged
    state.ledger.skipped = {e: set(shards) for e, shards in event.skipped.items()}  # (given up: not trained again)
    state.ledger.restore(event.rows)
    resumed = event.resumed_at
    state.ledger.resumed_at = max(event.ends, default=0) if resumed is None else resumed  # target, patience count from
    last = max([*event.merged, *event.skipped, *(meta["epoch"] for meta in event.pending), 0])
    done = {e: event.merged.get(e, set()) | event.skipped.get(e, set()) for e in {*event.merged, *event.skipped}}
    state.dispatch.restore(done, event.attempts, last)
    for epoch, (step, version) in event.ends.items():  # epochs finished before the restart
        state.ledger.epoch_end[epoch] = (step, float("nan"))
        if state.spec.validation is not None:
            submit_validation(state, version, step)
    for meta in event.pending:
        state.dispatch.take(meta["epoch"], meta["shard"])
    state.arrived += len(event.pending)  # results taken (from the store), for the merge path to settle


@_on.register
def _(event: m.StoreFault, state: RunState) -> None:
    store_fault(state, event.task, event.error)


@_on.register
def _(_event: m.StoreBack, state: RunState) -> None:
    store_back(state)


@_on.register
def _(event: m.Validated, state: RunState) -> None:
    state.ledger.validations[event.step] = event.metrics


@_on.register
def _(_event: m.CloseEpochs, state: RunState) -> None:
    close_epochs(state)


@_on.register
def _(_event: m.Finish, state: RunState) -> None:
    """The driver's loop is over: the results handed over after the last merge the run needed and the
    copies still out are turned down (cancelled)."""
    state.taking = False  # what is still out is the end's to cancel
    state.settled += state.settle_on_commit  # (the end commits what is merged)
    state.settle_on_commit = 0
    why = f"cancelled: {state.stopping or 'run finished'}"
    for task, _ in state.tasks.handed:
        if task.kind == "update":
            state.ledger.record_copy(task, "cancelled", why)
            state.settled += 1  # turned down: no task asking for its base waits for it
    state.tasks.handed.clear()
    leftover = tuple(k for k, _ in state.tasks.updates())
    state.out.append(m.Cancel(leftover))
    for key in leftover:
        copy = state.tasks.pop(key)
        if copy is not None:
            state.ledger.record_copy(copy, "cancelled", why)
