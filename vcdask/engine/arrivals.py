"""What comes back to a run: a shard's update (merged, or turned down and why) and a validation's numbers.

Functions of the :class:`~vcdask.engine.run.Run` (the event loop only); the merge itself runs in the
run's merge thread (:class:`~vcdask.engine.params_server.ParamsServer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import faults, policy, watch
from .inflight import TaskRecord

if TYPE_CHECKING:
    from .run import Run

__all__ = ["update", "validation"]


async def update(run: Run, rec: dict[str, Any], task: TaskRecord) -> None:
    """Merge (or turn down) one shard's result and record the outcome."""
    epoch, shard, worker = rec["epoch"], rec["shard"], rec["worker"]
    arrived = run.now()  # the history's time: when the result arrived, not when its merge finished
    wrec = run.pool.finished(
        worker,
        rec["seconds"],
        device=rec.get("device"),
        step_seconds=rec.get("step_seconds"),
        instance=rec.get("instance"),
        market=rec.get("market"),
    )
    fields = {k: rec[k] for k in ("train_loss", "seconds", "read_seconds", "train_seconds", "upload_seconds")}
    fields["wait_seconds"] = rec.get("wait_seconds", float("nan"))  # (absent from older uploads a resumed run merges)
    fields["first_loss"] = rec.get("first_loss", float("nan"))
    fields.update(worker=worker, device=rec.get("device"), update=rec["update"], base_version=rec["base_step"])
    fields.update(time=arrived, nbytes=rec.get("nbytes", float("nan")), fraction=rec.get("fraction", 1.0))
    fields["steps_ahead"] = rec.get("steps_ahead", 0)
    completes = False
    if run.ledger.done(epoch, shard):
        if task.overdue:
            row = run.ledger.record(
                epoch,
                shard,
                rec["attempt"],
                "late",
                **fields,
                reason="late: (epoch, shard) already merged from a re-issued copy",
            )
        else:
            row = run.ledger.record(
                epoch, shard, rec["attempt"], "duplicate", **fields, reason="duplicate: (epoch, shard) already merged"
            )
        if not run.spec.keep_updates:
            await run.lane.call(faults.drop_update, run.store, rec["update"])
    else:
        # the epoch's last shard is committed at once (its version is validated and closes the epoch)
        last = run.ledger.completes(epoch, shard)  # (recorded in the version's progress, for a resume)
        more = run.tasks.results_waiting()  # fold their commits
        ahead = next((r.get("update") for t, r in run.tasks.handed if t.kind == "update"), None)
        merged = await run.lane.merge(
            rec,
            completes=last,
            max_staleness=run.staleness_limit(),
            more=more,
            in_use_step=watch.in_use_step(run),
            ahead=ahead,  # the next handed-over update: read while this one is merged
        )
        if merged.pop("drafted", False):  # the tasks waiting for this merge start from its draft while it
            run.handshake.note_settled()  # is committed, before any other result is merged (a commit queued
            await run.lane.commit()  # meanwhile, by a skipped shard, may have done it already)
            merged["version_id"] = run.server.version
        fault = merged.pop("fault", None)
        row = run.ledger.record(
            epoch, shard, rec["attempt"], "merged" if merged["accepted"] else "rejected", **fields, **merged
        )
        if row["accepted"]:
            completes = run.ledger.merge(epoch, shard, rec["seconds"], run.server.step)
            run.dispatch.home[shard] = worker
            run.pool.credit(worker)
            await faults.cancel_other_copies(run, epoch, shard)
        else:
            await faults.rejected(run, epoch, shard, worker, row["reason"], fault)
    run.events.emit(
        "update",
        worker_row=wrec.as_row(),
        version=run.server.version,
        **{
            k: row[k]
            for k in (
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
        },
    )
    if not row["accepted"]:
        return
    if run.spec.validation is None:
        run.close_epochs()
        return
    if completes and not run.server.committed:  # another shard of the epoch was skipped during the merge
        await run.lane.commit()
    ledger = run.ledger
    due = policy.validation_due(
        run.spec.validate_every, run.server.step, ledger.validation_seconds, ledger.shard_seconds
    )
    if run.server.committed and (completes or due):
        run.submit_validation()


def validation(run: Run, rec: dict[str, Any]) -> None:
    """A validation task's numbers came back: record them; an epoch may close."""
    run.ledger.validate(rec["step"], rec["metrics"], rec.get("seconds"))
    run.close_epochs()
