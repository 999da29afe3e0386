"""What a run has done: merged and skipped shards, epochs, validations, the target, history rows.

The ledger is the run's memory of outcomes (the event loop only).  It publishes the changes the
panel follows (shard states, epochs) and decides when an epoch is complete: in one place.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..metrics import DERIVED_SUFFIXES
from . import policy
from .durations import Durations
from .events import ACTIVE_STATES, FINAL_STATES, EventLog, Outcome, ShardState

if TYPE_CHECKING:
    from .inflight import TaskRecord

__all__ = ["Ledger", "history_row"]


def history_row(epoch: int, shard: int, attempt: int, outcome: Outcome | None = None, **kw: Any) -> dict[str, Any]:
    """One row of ``FitResult.history``: every column, with ``kw`` filled in."""
    row = {
        "epoch": epoch,
        "shard": shard,
        "attempt": attempt,
        "worker": None,
        "device": None,
        "update": None,
        "base_version": None,
        "new_version": None,
        "version_id": None,
        "alpha": None,
        "staleness": None,
        "train_loss": float("nan"),
        "first_loss": float("nan"),
        "seconds": float("nan"),
        "read_seconds": float("nan"),
        "wait_seconds": float("nan"),
        "train_seconds": float("nan"),
        "upload_seconds": float("nan"),
        "nbytes": float("nan"),
        "fraction": float("nan"),
        "steps_ahead": float("nan"),
        "accepted": False,
        "outcome": outcome,
        "reason": None,
        "time": None,
    }
    row.update(kw)
    return row


class Ledger:
    """Outcomes of one run.

    Parameters
    ----------
    n_shards, max_epochs : int
    validated : bool
        Whether the run validates versions (an epoch closes once its end version is validated).
    target : dict, optional
        Metric -> goal; reaching it in an epoch's row stops the run.
    events : EventLog
    clock : callable, optional
        Seconds since the run started (for history rows and epoch wall times).
    """

    def __init__(
        self,
        n_shards: int,
        max_epochs: int,
        *,
        validated: bool,
        target: dict[str, float] | None,
        events: EventLog,
        clock: Callable[[], float] | None = None,
        patience: int | None = None,
        monitor: str | None = None,
    ):
        self.n_shards = n_shards
        self.max_epochs = max_epochs
        self.validated = validated
        self.target = target
        self.events = events
        started = time.time()
        self.clock = clock or (lambda: time.time() - started)
        self.merged: dict[int, set[int]] = {}
        self.skipped: dict[int, set[int]] = {}
        self.epoch_end: dict[int, tuple[int, float]] = {}  # epoch -> (step of its last merge, wall seconds)
        self.epochs: list[dict[str, Any]] = []
        self.validations: dict[int, dict[str, float]] = {}  # step -> metrics
        self.history: list[dict[str, Any]] = []
        self.shard_state: dict[tuple[int, int], ShardState] = {}
        self.shard_seconds = Durations()  # of merged updates: what deadlines derive from
        self.validation_seconds = Durations()  # of validations: what their deadline derives from
        #: Early stopping: stop once ``monitor`` has not improved for ``patience`` epochs.
        self.patience, self.monitor = patience, monitor
        self.best: dict[str, Any] | None = None  # {"epoch", "step", "value"} of the best epoch so far
        self.resumed_at = 0  # epochs done before a resume: the target and patience count from there
        #: A resumed run's epoch rows as its last session closed them (their losses, times, skips and bands).
        self.restored: dict[int, dict[str, Any]] = {}
        self._wall_before = 0.0  # the run's wall seconds in its earlier sessions (:meth:`restore`)

    def restore(self, rows: dict[int, dict[str, Any]]) -> None:
        """A resumed run's epoch rows as its last session closed them: their own numbers stay theirs, and the
        epochs this session closes count their ``wall_time`` on from the last of them."""
        self.restored = dict(rows)
        walls = [float(r["wall_time"]) for r in rows.values() if math.isfinite(r.get("wall_time", math.nan))]
        self._wall_before = max(walls, default=0.0)

    def wall(self) -> float:
        """Seconds of the run so far, its earlier sessions' included (an epoch row's ``wall_time``)."""
        return self._wall_before + self.clock()

    # -- shards ---------------------------------------------------------------------------------
    def done(self, epoch: int, shard: int) -> bool:
        """Whether (epoch, shard) is merged or skipped: no copy of it may be merged any more."""
        return shard in self.merged.get(epoch, ()) or shard in self.skipped.get(epoch, ())

    def is_merged(self, epoch: int, shard: int) -> bool:
        return shard in self.merged.get(epoch, ())

    def remaining(self, epoch: int) -> int:
        """Shards of ``epoch`` neither merged nor skipped."""
        return self.n_shards - len(self.merged.get(epoch, ())) - len(self.skipped.get(epoch, ()))

    def completes(self, epoch: int, shard: int) -> bool:
        """Whether merging (epoch, shard) would complete its epoch."""
        return not self.done(epoch, shard) and self.remaining(epoch) == 1

    def set_shard(self, epoch: int, shard: int, state: ShardState, why: str | None = None) -> None:
        """Move (epoch, shard) to ``state`` for the panel's grid (merged and skipped are final; a
        rejection stays visible until a copy is merged) and publish the change (with ``why``, if given)."""
        old = self.shard_state.get((epoch, shard))
        if old == state or old in FINAL_STATES or (old == "rejected" and state in ACTIVE_STATES):
            return
        self.shard_state[(epoch, shard)] = state
        self.events.emit("shard", epoch=epoch, shard=shard, state=state, **({} if why is None else {"why": why}))

    def note_merged(self, epoch: int, shard: int, seconds: float, step: int) -> bool:
        """(epoch, shard) was merged at ``step``; return whether that completed its epoch (which ends there).

        A shard given up while a copy of it was being merged (it cannot be taken out of ``W_s`` again) counts
        as merged, not skipped; an epoch that its skip ended already is not ended again.  A ``seconds``
        that is not finite (an upload merged on a resume, whose time nobody measured) is left out of the
        shard times that deadlines derive from."""
        ended = self.remaining(epoch) == 0
        if shard in self.skipped.get(epoch, ()):
            self.skipped[epoch].discard(shard)
            self.shard_state.pop((epoch, shard), None)  # (the grid shows it merged, not skipped)
        self.merged.setdefault(epoch, set()).add(shard)
        self.set_shard(epoch, shard, "merged")
        if math.isfinite(seconds):
            self.shard_seconds.append(seconds)
        if self.remaining(epoch) == 0 and not ended:
            self.epoch_end[epoch] = (step, self.wall())
            return True
        return False

    def skip(self, epoch: int, shard: int, step: int, why: str | None = None) -> bool:
        """Leave (epoch, shard) out of its epoch (``why``: for the panel and the console); return whether
        that completed the epoch."""
        self.skipped.setdefault(epoch, set()).add(shard)
        self.set_shard(epoch, shard, "skipped", why)
        if self.remaining(epoch) == 0:
            self.epoch_end[epoch] = (step, self.wall())
            return True
        return False

    def record(self, epoch: int, shard: int, attempt: int, outcome: Outcome, **kw: Any) -> dict[str, Any]:
        """Append one history row (``time``: now, unless given) and return it."""
        kw.setdefault("time", self.clock())
        row = history_row(epoch, shard, attempt, outcome, **kw)
        self.history.append(row)
        return row

    def record_copy(self, task: TaskRecord, outcome: Outcome, reason: str, **kw: Any) -> dict[str, Any]:
        """Append the history row of a shard copy that ended without a result (lost, cancelled, store fault)."""
        return self.record(task.epoch, task.shard, task.attempt, outcome, base_version=task.step, reason=reason, **kw)

    # -- epochs ---------------------------------------------------------------------------------
    def validate(self, step: int, metrics: dict[str, float], seconds: float | None = None) -> None:
        """Record the metrics of the version at ``step``: the first result counts (a validation run
        again elsewhere because it was late may come back twice)."""
        if seconds is not None:
            self.validation_seconds.append(seconds)
        if step in self.validations:
            return
        self.validations[step] = metrics
        self.events.emit("validation", step=step, metrics=metrics)

    def finished(self) -> bool:
        return len(self.epochs) >= self.max_epochs

    def close_epochs(self) -> str | None:
        """Record every epoch whose shards are all done (and whose end version is validated), in order.

        Epochs are dispatched without a barrier, so a late shard (a cold or slow worker) may finish its
        epoch after later epochs have ended.  An epoch's row is the model after that many passes: the
        first version by which its shards *and every earlier epoch's* are merged (the later of its own
        end and the row before it), so the rows' versions never go back, and an epoch held back by one
        late shard is not credited with the versions before it.

        Returns
        -------
        str or None
            Why the run should stop: an epoch reached the ``target``, or (early stopping) the
            ``monitor`` metric has not improved for ``patience`` epochs.
        """
        stop = None
        while True:
            epoch = len(self.epochs) + 1
            if epoch not in self.epoch_end:
                return stop
            end_step, wall = self.epoch_end[epoch]
            if self.epochs and self.epochs[-1]["version"] > end_step:
                # it ended before an earlier epoch's late shard: the row is the version (and time) that ended that
                end_step, wall = self.epochs[-1]["version"], self.epochs[-1]["wall_time"]
            if self.validated and end_step not in self.validations:
                return stop
            row = self._epoch_row(epoch, end_step, wall)
            self.epochs.append(row)
            self.events.emit("epoch", **row)
            if (
                self.target
                and epoch > self.resumed_at  # (a resumed run's target counts from the epochs it trains, as patience)
                and all(policy.reached(n, goal, row.get(n)) for n, goal in self.target.items())
            ):
                stop = stop or f"target {self.target} reached at epoch {epoch}"
            early = self._patience_out(epoch, end_step, row)
            if stop is None and early is not None:
                return early  # the run ends with this epoch (later ones may have merged shards already)

    def _patience_out(self, epoch: int, end_step: int, row: dict[str, Any]) -> str | None:
        """Track the best epoch of ``monitor``; why to stop once it is ``patience`` epochs behind."""
        if self.monitor is None:
            return None
        value = row.get(self.monitor)
        if policy.improved(self.monitor, value, None if self.best is None else self.best["value"]):
            self.best = {"epoch": epoch, "step": end_step, "value": value}
            return None
        if self.patience is None or self.best is None:
            return None
        # epochs since the best (or the resume) that brought a new version: an epoch that ended at the
        # version of the row before it (held back by a late shard of an earlier one) is no evidence
        since = max(self.best["epoch"], self.resumed_at)
        newer = {r["version"] for r in self.epochs if r["epoch"] > since} - {self.best["step"]}
        if len(newer) >= self.patience:
            return (
                f"early stopping: {self.monitor} has not improved for {self.patience} epochs "
                f"(best {self.best['value']:.6g} at epoch {self.best['epoch']})"
            )
        return None

    def _epoch_row(self, epoch: int, end_step: int, wall: float) -> dict[str, Any]:
        merges = [h for h in self.history if h["epoch"] == epoch and h["accepted"]]
        row: dict[str, Any] = {
            "epoch": epoch,
            "version": end_step,
            "wall_time": wall,
            "train_loss": _mean([h["train_loss"] for h in merges]),
            "skipped": len(self.skipped.get(epoch, ())),
        }
        before = self.restored.get(epoch)
        if before is not None and not merges:  # closed by an earlier session: what it measured
            row.update({k: before[k] for k in ("wall_time", "train_loss", "skipped") if k in before})
        if self.validated:
            # the band: every validated version that merged one of this epoch's updates, and its end (a
            # later version when a shard given up ended the epoch)
            end = self.validations[end_step]
            steps = {h["new_version"] for h in merges if h["new_version"] in self.validations} | {end_step}
            seen = [self.validations[s] for s in sorted(steps)]
            for name in end:
                values = [m[name] for m in seen]
                row[name] = end[name]
                row[f"{name}_mean"] = _mean(values)
                row[f"{name}_min"] = min(values)
                row[f"{name}_max"] = max(values)
            if before is not None and not merges:  # its band was over versions this session did not validate
                row.update({k: before[k] for k in row if k.endswith(DERIVED_SUFFIXES) and k in before})
        return row

    def last_merged(self) -> dict[str, Any] | None:
        """The history row of the newest merged update (None before the first)."""
        return next((h for h in reversed(self.history) if h["accepted"]), None)

    def last_staleness(self) -> int | None:
        last = self.last_merged()
        return None if last is None else last["staleness"]


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")
