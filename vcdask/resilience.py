"""Resilience options and the bookkeeping behind them: deadlines, worker records, update checks.

Pure Python and torch: nothing here talks to Dask or the store.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from .errors import VcdaskError
from .params import FlatParams

__all__ = ["FAILURE_POLICIES", "Resilience", "UnknownPolicyError", "WorkerRecord", "check_update"]

#: What to do with a shard that failed ``max_attempts`` times (killed its workers, or was rejected).
FAILURE_POLICIES = ("stop", "skip")


class UnknownPolicyError(VcdaskError, ValueError):
    """An ``on_shard_failure`` policy that does not exist."""


@dataclass(frozen=True)
class Resilience:
    """How a run copes with slow, failing, vanishing and misbehaving workers.

    Parameters
    ----------
    deadline : float, optional
        Seconds a shard task may take (from dispatch) before a copy is re-issued to another
        worker.  Default: ``max(deadline_floor, deadline_factor * tasks_per_slot * median shard time)``.
    deadline_factor, deadline_floor : float, default 4.0 and 5.0
        The automatic deadline's multiple of the running median, and its lower bound (seconds).
    max_staleness : int, "auto" or None, default "auto"
        Reject an update whose base version is more than this many merges old, and re-issue a
        shard task at once when the run has moved that far past its base (its result could only
        be rejected).  ``"auto"``: ``max(2 * n_shards, 4 * tasks in flight)``, far above what
        healthy workers produce, so that only a straggler's update is refused; ``None``: no limit
        (the paper's VC-ASGD merges every update, however old).
    max_update_norm : float, optional
        Reject an update whose distance ``||W_c - W_s||_2`` from the server copy exceeds this.
    max_attempts : int, default 4
        Attempts per (epoch, shard) — lost with a worker, rejected, timed out — before ``on_shard_failure``.
    on_shard_failure : {"stop", "skip"}, default "stop"
        ``"stop"`` ends the run with an error naming the shard; ``"skip"`` leaves the shard out of
        that epoch (recorded in the history) and goes on.
    max_worker_failures : int, default 3
        A worker with this many failures, timeouts and rejected updates gets no more shards.
    no_worker_timeout : float, default 300
        Seconds a run waits with no usable worker (none connected, or all excluded) for new
        workers to join, before it stops with an error.
    store_outage_timeout : float, default 600
        Seconds a run stays paused, retrying a commit, while the store is unreachable (beyond
        the storage client's own retries) before it stops with an error.
    """

    deadline: float | None = None
    deadline_factor: float = 4.0
    deadline_floor: float = 5.0
    max_staleness: int | str | None = "auto"
    max_update_norm: float | None = None
    max_attempts: int = 4
    on_shard_failure: str = "stop"
    max_worker_failures: int = 3
    no_worker_timeout: float = 300.0
    store_outage_timeout: float = 600.0

    def __post_init__(self):
        for name in ("deadline", "deadline_factor", "deadline_floor", "max_update_norm", "no_worker_timeout",
                     "store_outage_timeout"):
            value = getattr(self, name)
            if value is None and name in ("deadline", "max_update_norm"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.max_staleness not in (None, "auto") and (
            isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0
        ):
            raise ValueError(f"max_staleness must be an integer >= 0, 'auto' or None (no limit), "
                             f"got {self.max_staleness!r}")
        for name in ("max_attempts", "max_worker_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.on_shard_failure not in FAILURE_POLICIES:
            raise UnknownPolicyError(
                f"unknown on_shard_failure policy {self.on_shard_failure!r}; valid policies: {list(FAILURE_POLICIES)}"
            )

    def deadline_for(self, shard_seconds: list[float], tasks_per_slot: int, cold: bool = False) -> float:
        """The deadline in force, given the shard times seen so far.

        ``cold``: the worker has not finished a shard of this run yet (its first task also imports
        torch, reads the run's spec and its rows), so a derived deadline is at least
        ``COLD_START_SECONDS``.  An explicit ``deadline`` holds for every task."""
        if self.deadline is not None:
            return float(self.deadline)
        if not shard_seconds:
            return max(self.deadline_floor, 60.0)  # nothing measured yet: be patient with the first shards
        derived = max(self.deadline_floor, self.deadline_factor * tasks_per_slot * statistics.median(shard_seconds))
        return max(derived, COLD_START_SECONDS) if cold else derived


COLD_START_SECONDS = 30.0


@dataclass
class WorkerRecord:
    """What a run has seen of one worker."""

    address: str
    done: int = 0
    failed: int = 0
    timed_out: int = 0
    rejected: int = 0
    seconds: float = 0.0
    preempted: bool = False
    excluded: str | None = None
    recent: list[float] = field(default_factory=list)

    @property
    def faults(self) -> int:
        return self.failed + self.timed_out + self.rejected

    @property
    def mean_seconds(self) -> float:
        return self.seconds / self.done if self.done else float("nan")

    def rank(self) -> tuple:
        """Sort key: reliable first, then fast."""
        mean = self.mean_seconds
        return (self.faults, math.inf if math.isnan(mean) else mean)

    def as_row(self) -> dict:
        return {"worker": self.address, "done": self.done, "failed": self.failed, "timed_out": self.timed_out,
                "rejected": self.rejected, "mean_seconds": self.mean_seconds, "preempted": self.preempted,
                "excluded": self.excluded}


def staleness_limit(max_staleness: int | str | None, n_shards: int, in_flight: int) -> int | None:
    """The staleness limit in force: ``max_staleness`` itself, or for ``"auto"`` the larger of two
    epochs' worth of shards and four times the tasks in flight (healthy workers stay far below)."""
    if max_staleness == "auto":
        return max(2 * n_shards, 4 * in_flight)
    return max_staleness


def check_update(server: FlatParams, client: FlatParams, *, staleness: int, max_staleness: int | None,
                 max_norm: float | None) -> tuple[str, str] | None:
    """Why an update must not be merged, as ``(kind, reason)``, or None when it is fine.

    ``kind`` is ``"layout"``, ``"non-finite"``, ``"stale"`` or ``"norm"``; all but ``"stale"`` are the
    worker's fault.
    """
    if client.layout != server.layout:
        return "layout", "layout mismatch: " + "; ".join(server.layout.diff(client.layout)[:4])
    bad = []
    for name, value in client.state_dict().items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            bad.append(name)
    if bad:
        return "non-finite", f"non-finite values (NaN/inf) in {bad[:4]}{' ...' if len(bad) > 4 else ''}"
    if max_staleness is not None and staleness > max_staleness:
        return "stale", f"stale: based on a version {staleness} merges old (max_staleness={max_staleness})"
    if max_norm is not None:
        sq = sum(float(torch.sum((c.double() - s.double()) ** 2)) for d, c in client.arrays.items()
                 if c.is_floating_point() for s in [server.arrays[d]])
        norm = math.sqrt(sq)
        if norm > max_norm:
            return "norm", f"update norm ||W_c - W_s|| = {norm:.4g} > max_update_norm={max_norm:.4g}"
    return None
