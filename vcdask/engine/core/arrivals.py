"""What comes back to a run: a task's record (handed over by the task, or read through Dask), a shard's
update merged or turned down, a validation's numbers.

Functions of the :class:`~.state.RunState`.  The merge itself is an effect (:class:`~.messages.Merge`),
carried out in the run's merge thread; its outcome comes back as :class:`~.messages.Merged`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...updates import update_gone
from .. import policy
from ..inflight import TaskRecord
from .dispatching import fill, submit_validation
from .failures import close_epochs, retry_or_give_up, store_back, validate_head
from .messages import Cancel, DropUpdate, Merge, Read
from .rejections import rejected
from .state import RunState

if TYPE_CHECKING:
    from ..events import Outcome

__all__ = ["arrived", "completed", "hand_over", "merged", "taken"]

#: The fields of a merge's history row that its ``update`` event carries.
_EVENT_FIELDS = (
    "epoch",
    "shard",
    "worker",
    "accepted",
    "new_version",
    "staleness",
    "alpha",
    "train_loss",
    "reason",
    "outcome",
)


def hand_over(state: RunState, key: str, record: dict[str, Any]) -> list[str]:
    """A task's record, sent by the task as it finishes: its worker gets its next shard now; the record
    waits in the task table's ``handed`` queue for its merge.  The keys of the shard copies sent."""
    if not state.taking:  # the run is ending: its end reads (or cancels) what is still out
        return []
    task = state.tasks.pop(key)
    if task is None:  # Dask's report came first, or the copy was given up
        return []
    state.tasks.stale.add(key)
    state.handed_over += 1
    state.tasks.handed.append((task, record))  # first: the record is the run's now, whatever happens below
    return taken(state, task, record)


def taken(state: RunState, task: TaskRecord, record: dict[str, Any]) -> list[str]:
    """A shard result is in: its worker is free.  Give it its next shard before this result is
    merged, so the new task reads its spec and rows meanwhile; it then waits (briefly) for this
    merge before it trains (the base handshake).  The keys of the shard copies sent."""
    if task.kind != "update":
        return []
    state.arrived += 1
    return [] if state.finished() else fill(state, record["worker"])


#: Why a copy was cancelled that the run did not cancel: Dask cancels every client's futures on a
#: ``client.restart()``, and another client may cancel the run's keys.  It is sent again, nobody blamed.
OUTSIDE = "by Dask, not by the run (a client.restart(), or another client); sent again"


def completed(state: RunState, key: str, cancelled: bool) -> None:
    """Dask reports task ``key`` done: read its record back (a :class:`~.messages.Read`), unless it was
    handed over already, given up, or cancelled."""
    state.tasks.stale.discard(key)
    task = state.tasks.pop(key)
    if task is None:  # handed over by the task already, or given up
        return
    if cancelled:
        if task.kind == "update":
            if state.ledger.is_merged(task.epoch, task.shard):
                why = "superseded: another copy of this shard was merged"
            elif state.ledger.done(task.epoch, task.shard):
                why = "the shard was given up (skipped) for this epoch"
            elif state.stopping is not None:
                why = state.stopping
            else:
                why = OUTSIDE
            state.ledger.record_copy(task, "cancelled", f"cancelled: {why}")
            if why is OUTSIDE:  # (the run cancels only copies it has no more use for, or when it stops)
                retry_or_give_up(state, task.epoch, task.shard, why, count=False)
        elif state.stopping is None and task.step not in state.ledger.validations:
            submit_validation(state, task.version, task.step, retry=task.attempt + 1)  # (an epoch waits for it)
        return
    state.tasks.settle(task)  # (a running copy of its shard until its result is merged or lost)
    state.out.append(Read(key, task))


def arrived(state: RunState, task: TaskRecord, rec: dict[str, Any]) -> None:
    """Record a validation, or merge (or turn down) a shard's result: a late or duplicate copy is
    recorded as such and its update deleted (unless kept); any other goes to the merge thread."""
    store_back(state)
    if task.kind == "validation":
        state.tasks.settled(task)
        state.ledger.validate(rec["step"], rec["metrics"], rec.get("seconds"))
        close_epochs(state)
        return
    epoch, shard = rec["epoch"], rec["shard"]
    task.arrived = state.now()  # the history's time: when the result arrived, not when its merge finished
    state.pool.finished(
        rec["worker"],
        rec["seconds"],
        device=rec.get("device"),
        step_seconds=rec.get("step_seconds"),
        instance=rec.get("instance"),
        market=rec.get("market"),
    )
    if not state.ledger.done(epoch, shard):  # (it stays settling, a running copy, until it is merged)
        state.tasks.settle(task)
        ahead = next((r.get("update") for t, r in state.tasks.handed if t.kind == "update"), None)
        state.out.append(
            Merge(
                task,
                {**rec, "in_flight": state.pool.slots()},  # (fit's default rule follows a fleet that grows)
                # the epoch's last shard is committed at once (its version is validated and closes the epoch)
                completes=state.ledger.completes(epoch, shard),  # (recorded in the version's progress, for a resume)
                max_staleness=state.staleness_limit(),
                in_use_step=state.in_use_step(),
                ahead=ahead,  # the next handed-over update: read while this one is merged
            )
        )
        return
    state.tasks.settled(task)
    fields = _row_fields(task, rec)
    outcome: Outcome
    if not state.ledger.is_merged(epoch, shard):
        outcome, reason = "late", "late: (epoch, shard) was given up (skipped) meanwhile"
    elif task.overdue:
        outcome, reason = "late", "late: (epoch, shard) already merged from a re-issued copy"
    else:
        outcome, reason = "duplicate", "duplicate: (epoch, shard) already merged"
    row = state.ledger.record(epoch, shard, rec["attempt"], outcome, **fields, reason=reason)
    if update_gone("duplicate", state.spec.keep_updates):
        state.out.append(DropUpdate(rec["update"]))
    _settled(state, rec, row)


def merged(state: RunState, task: TaskRecord, rec: dict[str, Any], outcome: dict[str, Any]) -> None:
    """The merge thread merged (or turned down) a shard's result: record it; the shard's other copies
    are cancelled, or it is re-issued; a validation may be due."""
    state.tasks.settled(task)  # (before a rejection's re-issue looks for running copies)
    epoch, shard, worker = rec["epoch"], rec["shard"], rec["worker"]
    outcome = dict(outcome)
    fault = outcome.pop("fault", None)
    fields = _row_fields(task, rec)
    row = state.ledger.record(
        epoch, shard, rec["attempt"], "merged" if outcome["accepted"] else "rejected", **fields, **outcome
    )
    completes = False
    if row["accepted"]:
        completes = state.ledger.note_merged(epoch, shard, rec["seconds"], state.head.step)
        state.dispatch.home[shard] = worker
        state.pool.credit(worker)
        # the first valid result won: cancel the copies that have not started; one already running is
        # left to finish (cancelling cannot stop a running task): its result is recorded as late
        others = state.tasks.unstarted_copies(epoch, shard)
        if others:
            state.out.append(Cancel(others))
    else:
        rejected(state, epoch, shard, worker, row["reason"], fault)
    # the epoch's end version is committed before the tasks waiting for this result get their base
    commit_first = row["accepted"] and completes and state.spec.validation is not None and not state.head.committed
    _settled(state, rec, row, count=not commit_first)
    if not row["accepted"] or state.failure is not None:
        return
    if state.spec.validation is None:
        close_epochs(state)
        return
    if completes:  # (another shard of the epoch may have been skipped during the merge: commit first)
        if commit_first:
            state.settle_on_commit += 1
        validate_head(state)
        return
    ledger = state.ledger
    due = policy.validation_due(
        state.spec.validate_every, state.head.step, ledger.validation_seconds, ledger.shard_seconds
    )
    if due and state.head.committed:
        submit_validation(state)


def _settled(state: RunState, rec: dict[str, Any], row: dict[str, Any], count: bool = True) -> None:
    """A shard result is done with (merged, turned down, or recorded late): publish it, and (``count``)
    count it settled for the tasks waiting for their base (else its commit will)."""
    worker_row = state.pool.record(rec["worker"]).as_row()
    head = state.head  # (merge: what merges now, e.g. what "auto" chose)
    state.emit(
        "update", worker_row=worker_row, version=head.version, merge=head.rule, **{k: row[k] for k in _EVENT_FIELDS}
    )
    state.settled += int(count)


def _row_fields(task: TaskRecord, rec: dict[str, Any]) -> dict[str, Any]:
    """A shard result's history fields (``time``: when it arrived, not when its merge finished)."""
    fields = {k: rec[k] for k in ("train_loss", "seconds", "read_seconds", "train_seconds", "upload_seconds")}
    fields["wait_seconds"] = rec.get("wait_seconds", float("nan"))  # (absent from older uploads a resumed run merges)
    fields["first_loss"] = rec.get("first_loss", float("nan"))
    fields.update(worker=rec["worker"], device=rec.get("device"), update=rec["update"], base_version=rec["base_step"])
    fields.update(time=task.arrived, nbytes=rec.get("nbytes", float("nan")))
    fields["fraction"] = rec.get("fraction", 1.0)
    fields["steps_ahead"] = rec.get("steps_ahead", 0)
    return fields
