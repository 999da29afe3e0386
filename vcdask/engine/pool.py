"""The workers a run may use: who is connected, what each has done, who is excluded or draining.

The scheduler plugin tells the pool when workers join and leave (its ``add_worker`` /
``remove_worker`` hooks), and the run's shell what Dask says of each connected worker at every tick (its
status, its threads free: :meth:`WorkerPool.seen`); nothing here reads scheduler state.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from . import policy

if TYPE_CHECKING:
    from ..resilience import Resilience

__all__ = ["WorkerPool", "WorkerRecord"]

Fault = Literal["failed", "timed_out", "rejected"]

#: How many of a worker's latest shard times its record keeps (``recent``).
RECENT = 8
#: Weight of the newest result in a worker's moving average of seconds per training step.
SPEED_WEIGHT = 0.3
#: What a worker's Dask status other than ``running`` means for the run (said while it waits for workers).
DASK_STATUS = {"paused": "paused by Dask's memory manager (distributed.worker.memory.pause)"}


@dataclass
class WorkerRecord:
    """What a run has seen of one worker."""

    address: str
    done: int = 0
    failed: int = 0
    timed_out: int = 0
    rejected: int = 0
    repaid: int = 0  # rejections taken back by later merged updates (see WorkerPool.credit)
    merged: int = 0  # its updates merged (this session's)
    seconds: float = 0.0  # of the results whose time was measured (``timed``)
    timed: int = 0
    preempted: bool = False
    excluded: str | None = None
    unfit: str | None = None  # why it cannot train this run (no device of the run's...): excluded until it leaves
    last_fault: str | None = None  # why its last fault was one (e.g. a rejection's reason): said beside ``excluded``
    recent: list[float] = field(default_factory=list)
    device: str | None = None  # where it trains, as its last result said (e.g. "cuda:0 (NVIDIA H100 ...)")
    step_seconds: float = math.nan  # seconds per training step, a moving average over its results
    # cost accounting (vcdask.cost): its instance and market, as its results say; time connected, wasted
    instance: str | None = None
    market: str | None = None
    joined_at: float | None = None  # (the run's clock) since when it is connected; None while it is not
    alive_before: float = 0.0  # seconds connected before its last (re)join
    left_at: float | None = None  # (the run's clock) when it last left; None while connected
    wasted_seconds: float = 0.0  # seconds of its work lost to a preemption or to its death
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    def stop_clock(self) -> None:
        """Its time connected stops counting (it left, or the run ended)."""
        if self.joined_at is not None:
            self.alive_before, self.joined_at = self.alive_seconds, None

    @property
    def alive_seconds(self) -> float:
        return self.alive_before + (0.0 if self.joined_at is None else max(0.0, self.clock() - self.joined_at))

    @property
    def faults(self) -> int:
        return self.failed + self.timed_out + self.rejected

    def exclusion(self, res) -> str | None:
        """Why this worker gets no more shards (None while it may), the rejections it repaid not counted."""
        if self.unfit is not None:
            return self.unfit
        return policy.exclusion(self.failed, self.timed_out, self.rejected - self.repaid, res)

    @property
    def mean_seconds(self) -> float:
        return self.seconds / self.timed if self.timed else float("nan")

    def rank(self) -> tuple[int, float]:
        """Sort key: reliable first, then fast."""
        mean = self.mean_seconds
        return (self.faults, math.inf if math.isnan(mean) else mean)

    def as_row(self) -> dict[str, Any]:
        return {
            "worker": self.address,
            "device": self.device,
            "done": self.done,
            "failed": self.failed,
            "timed_out": self.timed_out,
            "rejected": self.rejected,
            "mean_seconds": self.mean_seconds,
            "preempted": self.preempted,
            "excluded": self.excluded,
            "instance": self.instance,
            "market": self.market,
            "alive_seconds": self.alive_seconds,
            "busy_seconds": self.seconds,
            "wasted_seconds": self.wasted_seconds,
        }


class WorkerPool:
    """The connected workers and the run's record of each.

    Parameters
    ----------
    res : Resilience
        ``max_worker_failures`` decides exclusion.
    tasks_per_slot : int
        Shard copies kept in flight per worker thread.
    connected : mapping of str to int
        The workers connected when the run starts: address -> threads.
    clock : callable, optional
        The run's clock (seconds), for the time each worker is connected.
    """

    def __init__(
        self,
        res: Resilience,
        tasks_per_slot: int,
        connected: Mapping[str, int],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.res = res
        self.tasks_per_slot = tasks_per_slot
        self.clock = clock
        self.connected: dict[str, int] = {}
        self.records: dict[str, WorkerRecord] = {}
        self.draining: set[str] = set()  # preempted: no new shards
        # what Dask said at the last tick (WorkerPool.seen): connected workers whose status is not "running",
        # and each one's threads running no task (anyone's); unknown until the shell has looked
        self.dask_status: dict[str, str] = {}
        self.free: dict[str, int] = {}
        for address, nthreads in connected.items():
            self.joined(address, nthreads)

    # -- membership (from the scheduler plugin's hooks) ----------------------------------------
    def joined(self, address: str, nthreads: int) -> None:
        """``address`` joined, or joined again: a worker unfit for the run that left (:meth:`unfit`) comes back
        without that exclusion (a new process there, started after its environment was fixed); faults stay."""
        self.connected[address] = nthreads
        rec = self.record(address)
        if rec.left_at is not None and rec.unfit is not None:
            rec.excluded = None if rec.excluded == rec.unfit else rec.excluded
            rec.unfit = None
        rec.left_at = None
        if rec.joined_at is None:
            rec.joined_at = self.clock()

    def left(self, address: str) -> None:
        self.connected.pop(address, None)
        self.dask_status.pop(address, None)
        self.free.pop(address, None)
        rec = self.records.get(address)
        if rec is not None:
            rec.stop_clock()
            rec.left_at = self.clock()

    def seen(self, workers: Mapping[str, tuple[str, int]]) -> None:
        """What Dask says of its workers (address -> (status, threads running no task)), read by the run's
        shell at each tick: no plugin hook reports a status change.  A worker whose status is not
        ``running`` gets no shards: Dask starts nothing on a worker its memory manager paused, nor on one
        closing, and a copy sent there would only wait (the run waits too, and says why)."""
        self.dask_status = {a: s for a, (s, _) in workers.items() if a in self.connected and s != "running"}
        self.free = {a: free for a, (_, free) in workers.items() if a in self.connected}

    def stop_clocks(self) -> None:
        """The run ended: every worker's time connected stops counting (its cost with it), connected or not."""
        for rec in self.records.values():
            rec.stop_clock()

    def identify(self, address: str, instance: str | None, market: str | None) -> None:
        """``address`` says it runs on ``instance`` bought on ``market`` (for the cost accounting)."""
        rec = self.record(address)
        rec.instance, rec.market = instance or rec.instance, market or rec.market

    def wasted(self, address: str | None, seconds: float) -> None:
        """``seconds`` of work on ``address`` were lost (its copy re-issued on a notice, or it died)."""
        if address is not None and seconds > 0:
            self.record(address).wasted_seconds += seconds

    def lost(self, address: str | None, ran: float) -> None:
        """A copy that had run ``ran`` seconds on ``address`` runs again elsewhere (Dask moved it: the worker died
        or left): its work there was lost, up to when the worker left (not the wait for a new one after it)."""
        rec = self.records.get(address) if address is not None else None
        since_left = 0.0 if rec is None or rec.left_at is None else max(0.0, self.clock() - rec.left_at)
        self.wasted(address, ran - since_left)

    # -- records --------------------------------------------------------------------------------
    def record(self, address: str) -> WorkerRecord:
        rec = self.records.get(address)
        if rec is None:
            rec = self.records[address] = WorkerRecord(address, clock=self.clock)
        return rec

    def finished(
        self,
        address: str,
        seconds: float,
        device: str | None = None,
        step_seconds: float | None = None,
        instance: str | None = None,
        market: str | None = None,
    ) -> WorkerRecord:
        """``address`` handed back a shard's result after ``seconds``, trained on ``device`` at
        ``step_seconds`` per training step (its median step), on ``instance`` bought on ``market``.  A
        ``seconds`` that is not finite (an upload a resumed run merges: nobody measured it) counts the
        result, not its time."""
        rec = self.record(address)
        rec.device = device or rec.device
        self.identify(address, instance, market)
        rec.done += 1
        if math.isfinite(seconds):  # (an upload merged on a resume: nobody measured its time)
            rec.timed += 1
            rec.seconds += seconds
            rec.recent = [*rec.recent[-(RECENT - 1) :], seconds]
        if step_seconds is not None and step_seconds >= 0:
            per_step = step_seconds
            old = rec.step_seconds
            rec.step_seconds = per_step if math.isnan(old) else (1 - SPEED_WEIGHT) * old + SPEED_WEIGHT * per_step
        return rec

    def work_fraction(self, address: str) -> float:
        """The share of a shard's batches a task on ``address`` trains, when the run adapts work to
        speed (see :func:`vcdask.engine.policy.work_fraction`): against the fastest usable worker."""
        speeds = [self.records[a].step_seconds for a in self.usable() if a in self.records]
        known = [s for s in speeds if not math.isnan(s)]
        rec = self.records.get(address)
        if rec is None or not known:
            return 1.0
        return policy.work_fraction(rec.step_seconds, min(known))

    def fault(self, address: str, kind: Fault, why: str | None = None) -> str | None:
        """Count a fault against ``address`` (``why``: what it was, said with its exclusion); return why it is
        now excluded, if this excluded it."""
        rec = self.record(address)
        setattr(rec, kind, getattr(rec, kind) + 1)
        if why is not None:
            rec.last_fault = why
        if rec.excluded is not None:
            return None
        rec.excluded = rec.exclusion(self.res)
        return rec.excluded

    def unfit(self, address: str, why: str) -> bool:
        """``address`` cannot train this run (``why``: it has no device of the run's): it gets no more shards,
        whatever its faults.  Whether this excluded it (it was not already)."""
        rec = self.record(address)
        rec.unfit = why
        newly = rec.excluded is None
        rec.excluded = why
        return newly

    def forgive(self, address: str, kind: Fault) -> None:
        """Take back a fault counted against ``address`` (it was not the worker's): an exclusion it
        caused is lifted."""
        rec = self.record(address)
        setattr(rec, kind, max(0, getattr(rec, kind) - 1))
        rec.repaid = min(rec.repaid, rec.rejected)
        rec.excluded = rec.exclusion(self.res)

    def credit(self, address: str) -> None:
        """An update of ``address`` was merged: it repays one rejection counted against it, if any.

        Robust merging's screens reject an honest update now and then (0.5-2% on digits with SGD, late in
        training, where an honest pseudo-gradient's direction is mostly noise); over a long run those
        would add up to ``max_worker_failures`` and exclude an honest worker.  A worker whose updates are
        all rejected repays nothing and is excluded as before.  (Its ``rejected`` count stays the total.)"""
        rec = self.record(address)
        rec.merged += 1
        if rec.repaid < rec.rejected and rec.excluded is None:
            rec.repaid += 1

    def drain(self, address: str) -> None:
        """A preemption notice: ``address`` gets no new shards."""
        self.draining.add(address)
        self.record(address).preempted = True

    def cold(self, address: str | None) -> bool:
        """Whether ``address`` has not finished a shard of this run yet."""
        return address is not None and self.record(address).done == 0

    # -- views ----------------------------------------------------------------------------------
    def usable(self) -> list[str]:
        """Workers that may get shards: connected, running as Dask says (not paused), not excluded, not draining;
        most reliable and fastest first."""
        ok = [
            a
            for a in self.connected
            if a not in self.draining and a not in self.dask_status and not self.record(a).excluded
        ]
        return sorted(ok, key=lambda a: self.record(a).rank())

    def room(self) -> bool:
        """Whether a usable worker has a thread that runs no task (as Dask last said; one not looked at yet
        counts as free).  A copy that never started while every thread is busy (another client's tasks,
        the run's own) would gain nothing from a second copy: it would wait as well."""
        return any(self.free.get(a, 1) > 0 for a in self.usable())

    def share(self, address: str) -> int:
        """Shard copies one worker holds at most: ``tasks_per_slot`` per thread (1 thread if unknown)."""
        return self.tasks_per_slot * self.connected.get(address, 1)

    def slots(self) -> int:
        """Shard copies to keep in flight: the usable workers' shares."""
        return max(1, sum(self.share(a) for a in self.usable()))

    def unusable(self) -> dict[str, str]:
        """Connected workers that get no shards, and why (an excluded one's last fault with it: a setting
        that rejects every update shows there, not only as a count)."""
        states = {}
        usable = self.usable()
        for a in self.connected:
            if a not in usable:
                rec = self.record(a)
                last = f"; last: {rec.last_fault}" if rec.excluded and rec.last_fault else ""
                states[a] = f"{rec.excluded}{last}" if rec.excluded else self._status_why(a) or "draining"
        return states

    def _status_why(self, address: str) -> str | None:
        status = self.dask_status.get(address)
        return None if status is None else DASK_STATUS.get(status, f"{status} (its Dask status)")

    def cause(self) -> str:
        """Why no worker is usable, in a few words (said as the run pauses, in its status and its error): e.g.
        "every worker is paused by Dask's memory manager (...)"."""
        if not self.connected:
            return "no worker connected"
        whys = ["excluded" if self.record(a).excluded else self._status_why(a) or "draining" for a in self.unusable()]
        if len(set(whys)) == 1:
            return f"{'every worker is' if len(whys) > 1 else 'the only worker is'} {whys[0]}"
        return ", ".join(f"{whys.count(w)} {w}" for w in dict.fromkeys(whys))

    def rows(self) -> list[dict[str, Any]]:
        return [w.as_row() for w in self.records.values()]
