"""The server copy ``W_s`` of one run and its merge path: read ``W_c``, merge, commit.

Everything here runs in the run's merge thread, never on the scheduler's event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .merge import vc_asgd
from .params import FlatParams
from .resilience import check_update
from .updates import read_update

__all__ = ["ServerState"]


class ServerState:
    """``W_s`` in memory, the merge counter ``step`` and the newest committed version.

    Parameters
    ----------
    store : ParamStore
    branch : str
        The run's branch; commits are compare-and-swap on its head, so a second
        writer on the branch is detected, never silently interleaved.
    alpha : callable
        ``epoch -> alpha``.
    run_id : str
    commit_every : int
        Commit after this many merges (``merge(..., force_commit=True)`` commits at once).
    keep_updates : bool
        Keep update objects after their merge is committed.
    """

    def __init__(self, store, branch: str, alpha: Callable[[int], float], run_id: str, *,
                 commit_every: int = 1, keep_updates: bool = False, max_staleness: int | None = None,
                 max_update_norm: float | None = None):
        self.store = store
        self.branch = branch
        self.alpha = alpha
        self.run_id = run_id
        self.commit_every = commit_every
        self.keep_updates = keep_updates
        self.max_staleness = max_staleness
        self.max_update_norm = max_update_norm
        self.params: FlatParams | None = None
        self.step = 0
        #: (newest committed version id, its step), replaced as one object so that the
        #: event loop never reads a version with another version's step.
        self.head: tuple[str | None, int] = (None, 0)
        self.uncommitted: list[dict[str, Any]] = []

    def load(self) -> None:
        """Start from the newest version on the branch."""
        checkpoint = self.store.read(branch=self.branch)
        self.params = checkpoint.params.clone()
        self.step = int(checkpoint.metadata.get("step", 0))
        self.head = (checkpoint.version, self.step)

    @property
    def version(self) -> str | None:
        """The newest committed version id."""
        return self.head[0]

    @property
    def version_step(self) -> int:
        """The step of the newest committed version."""
        return self.head[1]

    @property
    def committed(self) -> bool:
        """Whether every merge so far is in a committed version."""
        return self.version_step == self.step

    def merge(self, record: dict[str, Any], force_commit: bool = False) -> dict[str, Any]:
        """Merge the update described by ``record`` (epoch, shard, attempt, base_step, update path).

        Returns the history fields of the merge: accepted, alpha, new_version, staleness, version_id;
        or, for an update that fails :func:`~vcdask.resilience.check_update`, ``accepted=False``
        with the ``reason`` and ``fault`` kind — ``W_s`` is then untouched.
        """
        staleness = self.step - record["base_step"]
        try:
            client = read_update(self.store.files, record["update"])
        except (ValueError, KeyError, OSError) as e:  # an unreadable object is a rejected update, not a crash
            return self._reject(record, staleness, "unreadable", f"unreadable update: {e}")
        problem = check_update(self.params, client, staleness=staleness, max_staleness=self.max_staleness,
                               max_norm=self.max_update_norm)
        if problem is not None:
            return self._reject(record, staleness, *problem)
        alpha = float(self.alpha(record["epoch"]))
        vc_asgd(self.params, client, alpha)
        self.step += 1
        self.uncommitted.append(record)
        if force_commit or len(self.uncommitted) >= self.commit_every:
            self.commit()
        return {"accepted": True, "alpha": alpha, "new_version": self.step,
                "staleness": self.step - 1 - record["base_step"],
                "version_id": self.version if self.committed else None}

    def _reject(self, record: dict[str, Any], staleness: int, fault: str, reason: str) -> dict[str, Any]:
        if not self.keep_updates:
            self.store.files.delete(record["update"])
        return {"accepted": False, "staleness": staleness, "reason": reason, "fault": fault}

    def commit(self) -> None:
        """Commit the merges not yet in a version (no-op when there are none)."""
        if not self.uncommitted:
            return
        last = self.uncommitted[-1]
        version = self.store.commit(
            self.params,
            {"run_id": self.run_id, "step": self.step, "epoch": last["epoch"],
             "merged": [[r["epoch"], r["shard"], r["attempt"]] for r in self.uncommitted],
             "alpha": float(self.alpha(last["epoch"]))},
            branch=self.branch, message=f"{self.run_id} step {self.step}", parent=self.version,
        )
        self.head = (version, self.step)
        if not self.keep_updates:
            for r in self.uncommitted:  # merged and committed: the update has done its job
                self.store.files.delete(r["update"])
        self.uncommitted = []
