"""Resilience options: how a run copes with slow, failing, vanishing and misbehaving workers.

The decisions these options drive are in :mod:`vcdask.engine.policy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._ints import is_real
from .errors import UnknownPolicyError

__all__ = ["FAILURE_POLICIES", "Resilience", "UnknownPolicyError"]

#: Options that may be None (off).
OPTIONAL = ("deadline", "max_update_norm", "clip_update_norm", "max_norm_ratio", "probe_tolerance")
#: Options that screen updates against a probe of the validation set (they need ``validation=``).
NEEDS_VALIDATION = ("probe_tolerance",)

#: Options that reject updates by what they changed from their base (:mod:`vcdask.engine.guard`).
REJECTING_SCREENS = ("max_norm_ratio", "min_cosine", "probe_tolerance")

#: What to do with a shard that failed ``max_attempts`` times (killed its workers, or was rejected).
FAILURE_POLICIES = ("stop", "skip")


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
        Reject an update whose distance ``||W_c - W_s||_2`` from the server copy exceeds this, over the
        parameters (buffers such as BatchNorm's running statistics left out: they are no step).
    clip_update_norm : float, optional
        Robust merging (see :mod:`vcdask.engine.guard`): scale a pseudo-gradient ``W_c - W_base``
        longer than this down to this length before it is merged.
    max_norm_ratio : float, optional
        Robust merging: reject a pseudo-gradient longer than this multiple of the reference (the
        median of recent merged ones; at first, the server's own step on the update's shard).  3
        rejects scaled-up updates and leaves honest ones alone (measured on digits, SGD and Adam).
    min_cosine : float, optional
        Robust merging: reject a pseudo-gradient whose cosine with the server's own step on the
        update's shard (a few steps of the run's optimizer on its first rows, from the update's
        base) is below this.  0 rejects sign-flipped updates.
    probe_tolerance : float, optional
        Robust merging: reject an update whose loss on a probe of the validation set (its first 256
        rows) exceeds its base version's by more than this fraction (2.0: three times the loss; a net
        for gross damage, as honest updates can raise it by most of their base's loss).
        ``probe_tolerance`` needs ``fit(validation=...)``.
    max_attempts : int, default 4
        Attempts per (epoch, shard) — lost with a worker, rejected, timed out, or (with ``"skip"``) raised
        by the step, the loss or the data — before ``on_shard_failure``.
    on_shard_failure : {"stop", "skip"}, default "stop"
        ``"stop"`` ends the run with an error naming the shard (and at once when a shard task raises);
        ``"skip"`` leaves the shard out of that epoch (recorded in the history) and goes on, unless
        every shard of an epoch is given up.
    max_worker_failures : int, default 3
        A worker with this many failures, timeouts and rejected updates gets no more shards.
    no_worker_timeout : float, default 300
        Seconds a run waits with no usable worker (none connected, or all excluded) for new
        workers to join, before it stops with an error.
    store_outage_timeout : float, default 600
        Seconds a run stays paused, retrying a commit, while the store is unreachable (beyond
        the storage client's own retries) before it stops with an error.  It is checked between
        attempts, and one attempt on S3 can itself take ~15-45 s of the client's retries, so a
        run stops up to that much later.
    """

    deadline: float | None = None
    deadline_factor: float = 4.0
    deadline_floor: float = 5.0
    max_staleness: int | str | None = "auto"
    max_update_norm: float | None = None
    clip_update_norm: float | None = None
    max_norm_ratio: float | None = None
    min_cosine: float | None = None
    probe_tolerance: float | None = None
    max_attempts: int = 4
    on_shard_failure: str = "stop"
    max_worker_failures: int = 3
    no_worker_timeout: float = 300.0
    store_outage_timeout: float = 600.0

    @property
    def rejects_updates(self) -> bool:
        """Whether an update may be rejected by what it changed from its base (:data:`REJECTING_SCREENS`)."""
        return any(getattr(self, name) is not None for name in REJECTING_SCREENS)

    def __post_init__(self):
        for name in (
            "deadline",
            "deadline_factor",
            "deadline_floor",
            "max_update_norm",
            "clip_update_norm",
            "max_norm_ratio",
            "probe_tolerance",
            "no_worker_timeout",
            "store_outage_timeout",
        ):
            value = getattr(self, name)
            if value is None and name in OPTIONAL:
                continue
            if not is_real(value) or math.isnan(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.min_cosine is not None and (not is_real(self.min_cosine) or not -1 <= self.min_cosine < 1):
            raise ValueError(f"min_cosine must be a number in [-1, 1), got {self.min_cosine!r}")
        if self.max_staleness not in (None, "auto") and (
            isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0
        ):
            raise ValueError(
                f"max_staleness must be an integer >= 0, 'auto' or None (no limit), got {self.max_staleness!r}"
            )
        for name in ("max_attempts", "max_worker_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.on_shard_failure not in FAILURE_POLICIES:
            raise UnknownPolicyError(
                f"unknown on_shard_failure policy {self.on_shard_failure!r}; valid policies: {list(FAILURE_POLICIES)}"
            )
