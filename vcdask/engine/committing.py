"""The commit half of a run's parameter server: commit the merges not yet in a version, through store
outages and lost answers, and apply the run's retention policy between merges.

:class:`Committing` is a mixin of :class:`~vcdask.engine.params_server.ParamsServer` (it uses the
server's attributes: ``store``, ``branch``, ``params``, ``rule``, ``rule_state``, ``follow``, ``uncommitted``,
``progress``, ``head`` ...); it is a module of its own only to keep the merge path readable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import StoreAccessDeniedError, StoreConflict, StoreError, StoreNotFoundError, VersionNotFoundError
from ..params import copies_within
from ..updates import update_gone
from .outage import retry_through
from .side import SideThread

if TYPE_CHECKING:
    from collections import OrderedDict, deque

    from ..merge import MergeRule, RuleState
    from ..params import FlatParams
    from ..store import Retention
    from .progress import Progress

#: Base versions of compressed updates the merge thread keeps in memory (the newest commits).
BASES_KEPT = 8
#: ... and at most this many bytes of them (two at least); an update based on one dropped reads it from the store
BASES_BYTES = 1 << 30
#: A collection starts no sooner than this many times the last one's duration after that one began.
COST_RATIO = 10

__all__ = ["BASES_BYTES", "BASES_KEPT", "COST_RATIO", "Committing", "Head", "collection_due", "trim_bases"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Head:
    """Where the server stands, as the merge thread publishes it: merges so far, the newest committed
    version with its step, and what the merge thread is doing.

    ``payload``: that version's parameters packed for a Dask message (:func:`vcdask._wire.pack`), when
    they are small (``ParamsServer(inline_bytes=...)``).  ``draft``: the parameters at ``step``, packed
    the same way, while they are being committed (``ParamsServer(drafts=True)``): the loop may give them
    as a base before their version id exists.  ``folded``: merges wait for a commit only because more
    results were queued.  ``paused``: why the server waits for the store, while it does; ``waiting``:
    the store request under way, and since when (``time.monotonic()``).  ``rule``: what merges now, in
    a few words (:meth:`vcdask.merge.MergeRule.label`: what ``"auto"`` chose).

    The merge thread replaces it as a whole; the loop reads all of it in one attribute read: no other
    attribute of the server crosses from one thread to the other.
    """

    step: int = 0
    version: str | None = None
    version_step: int = 0
    payload: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    draft: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    folded: bool = False
    paused: str | None = None
    waiting: tuple[str, float] | None = None
    rule: str | None = None

    @property
    def committed(self) -> bool:
        """Whether every merge so far is in a committed version."""
        return self.version_step == self.step


def collection_due(retention: Retention, since: float, backlog: int, last: float) -> bool:
    """Whether a run collects now, ``since`` seconds after its last collection began (which took
    ``last`` seconds), with ``backlog`` bytes of parameters committed since (see :meth:`Committing.collect`)."""
    if since >= retention.interval:
        return True
    limit = retention.backlog_bytes
    return limit is not None and backlog >= limit and since >= COST_RATIO * last


class Committing:
    """Commits and retention for :class:`~vcdask.engine.params_server.ParamsServer`."""

    # set by ParamsServer.__init__
    store: Any
    branch: str
    run_id: str
    rule: MergeRule
    rule_state: RuleState
    follow: int | None
    params: FlatParams | None
    head: Head
    uncommitted: list[dict[str, Any]]
    progress: Progress
    keep_updates: bool
    outage_timeout: float
    retention: Retention | None
    in_use_step: int | None
    keep_from: int
    collect_seconds: list[float]
    stage_seconds: dict[str, deque[float]]
    _collected: float
    _backlog: int
    _said_held_back: bool
    _bases: OrderedDict[str, FlatParams]
    side: SideThread
    inline_bytes: int
    drafts: bool

    def commit(self) -> None:
        """Commit the merges not yet in a version (no-op when there are none).

        A commit is never applied twice: when the store reports a conflict, the branch head is
        checked first — if it is this very commit (the store took it but its answer was lost),
        it is adopted.  While the store is unreachable past its own retries, the run pauses
        here (``paused`` says why) and tries again with backoff, up to ``outage_timeout`` seconds.
        """
        if not self.uncommitted:
            return
        last = self.uncommitted[-1]
        metadata = {
            "run_id": self.run_id,
            "step": self.head.step,
            "epoch": last["epoch"],
            "merged": [[r["epoch"], r["shard"], r["attempt"]] for r in self.uncommitted],
            "merge": self.rule.describe(),
            "progress": self.progress.as_metadata(),
        }
        if self.follow is not None:  # (fit's default rule: the tasks in flight it was chosen for)
            metadata["merge_in_flight"] = self.follow
        schedule = getattr(self.rule, "schedule", None)
        if schedule is not None:
            metadata["alpha"] = float(schedule(last["epoch"]))
        if self.rule_state.scalars:
            metadata["rule_state"] = dict(self.rule_state.scalars)
        t0 = time.perf_counter()
        version = self._through_outages(lambda: self._commit_once(metadata), f"committing step {self.head.step}")
        self.stage_seconds["commit"].append(time.perf_counter() - t0)
        draft = self.head.draft  # (the parameters just committed, packed already)
        self.head = replace(
            self.head,
            version=version,
            version_step=self.head.step,
            payload=self.packed() if draft is None else draft,
            draft=None,
            folded=False,
        )
        self._backlog += self.params.nbytes if self.params is not None else 0
        if self._bases and self.params is not None:  # compressed updates: the next ones start from here
            self._bases[version] = self.params.clone()
            trim_bases(self._bases, self.params.nbytes)
        if update_gone("committed", self.keep_updates):
            for r in self.uncommitted:  # merged and committed: the update has done its job
                self.side.delete(r["update"])
        self.uncommitted = []
        self.collect()

    def packed(self) -> dict[str, Any] | None:
        """``W_s`` packed for the answers that give its version as a base (:attr:`Head.payload`), if
        it is at most ``inline_bytes``: a copy, taken as it is committed."""
        from .._wire import pack

        if self.params is None or not 0 < self.params.nbytes <= self.inline_bytes:
            return None
        return pack(self.params)

    def collect(self, final: bool = False) -> None:
        """Apply the run's retention policy to its branch (:meth:`vcdask.ParamStore.gc`).

        Once ``retention.interval`` seconds have passed since the last collection began, or sooner
        once the versions committed since then hold ``retention.backlog_bytes`` (but not sooner than
        :data:`COST_RATIO` times the last collection's duration after it began: collecting takes at
        most about a tenth of the thread's time); ``final``: now.  In the merge thread, so it never runs beside a commit
        of this run.  Versions at or after ``in_use_step`` (what the run's tasks read) are kept.  A
        failed collection is logged and tried again later: nothing is lost meanwhile, the store
        only holds more.
        """
        if self.retention is None or self.head.version is None:
            return
        last = self.collect_seconds[-1] if self.collect_seconds else 0.0
        if not final and not collection_due(self.retention, time.monotonic() - self._collected, self._backlog, last):
            return
        self._collected = t0 = time.monotonic()
        self._backlog = 0
        head_step = self.head.version_step
        in_use = head_step if self.in_use_step is None else min(self.in_use_step, head_step)
        try:
            report = self.store.gc(self.retention, branches=[self.branch], in_use={self.branch: in_use})
        except (StoreError, VersionNotFoundError) as e:  # e.g. another collection removed what this one read
            logger.warning("run %s: collecting old versions failed (tried again later): %s", self.run_id, e)
            return
        self.keep_from = max(self.keep_from, head_step)  # everything older it keeps is pinned now
        self.collect_seconds.append(time.monotonic() - t0)
        if report.held_back and not self._said_held_back:  # once per run
            self._said_held_back = True
            logger.warning(
                "run %s: retention cannot remove all it should: %s", self.run_id, "; ".join(report.held_back)
            )
        logger.debug("run %s: retention removed %d versions", self.run_id, report.n_removed)

    def _commit_once(self, metadata: dict[str, Any]) -> str:
        try:
            return self.store.commit(
                self.params,
                metadata,
                branch=self.branch,
                parent=self.head.version,
                message=f"{self.run_id} step {self.head.step}",
                state=self.rule_state.arrays,
                keep_from=self._keep_from(),
            )
        except StoreConflict as e:
            version = self._landed(metadata)
            if version is None:  # somebody else writes to this run's branch: never interleave
                raise StoreConflict(
                    f"run {self.run_id}: {e}. Another driver is writing this run: it was resumed on another "
                    "scheduler while it ran here (or another run writes its branch); this session of it stops. "
                    "Follow the other one with vcdask.attach(run_id, its scheduler)"
                ) from e
            logger.warning(
                "run %s: commit of step %d had landed although the store reported a "
                "conflict (a lost response); adopting version %s",
                self.run_id,
                self.head.step,
                version,
            )
            return version
        except (StoreNotFoundError, StoreAccessDeniedError):
            raise
        except StoreError as e:
            if e.unsent:  # it failed before the commit was sent: it cannot have landed
                raise
            version = self._landed(metadata, quiet=True)  # the store may have taken it before failing
            if version is None:
                raise
            return version

    def _keep_from(self) -> int | None:
        """The marker for other collectors: this run may still need its versions from this step on."""
        if self.retention is None:
            return None
        in_use = self.head.version_step if self.in_use_step is None else self.in_use_step
        return min(in_use, self.keep_from)

    def _through_outages(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` through store outages (:func:`~vcdask.engine.outage.retry_through`); ``waiting`` and
        ``paused`` say what the server waits for meanwhile."""

        def attempt() -> Any:
            self.head = replace(self.head, waiting=(what, time.monotonic()))
            try:
                return fn()
            finally:
                self.head = replace(self.head, waiting=None)

        def on_wait(why: str | None) -> None:
            self.head = replace(self.head, paused=why)

        return retry_through(attempt, f"run {self.run_id}: {what}", self.outage_timeout, on_wait=on_wait)

    def _landed(self, metadata: dict[str, Any], quiet: bool = False) -> str | None:
        """The id of the branch head if it is exactly the commit described by ``metadata``, else None."""
        try:
            head = self.store.versions(self.branch)[0]
        except (StoreError, IndexError):
            if quiet:
                return None
            raise
        same = (
            head.parent == self.head.version
            and head.metadata.get("run_id") == self.run_id
            and head.metadata.get("step") == metadata["step"]
            and head.metadata.get("merged") == metadata["merged"]
        )
        return head.id if same else None


def trim_bases(bases: OrderedDict, nbytes: int) -> None:
    """Drop the oldest of ``bases`` (the versions compressed updates are based on, each ``nbytes``) past
    :data:`BASES_KEPT` and :data:`BASES_BYTES` (8 copies of a 264 MB model were kept on the scheduler: in a
    notebook's process, with the embedded cluster)."""
    kept = copies_within(BASES_KEPT, BASES_BYTES, nbytes)
    while len(bases) > kept:
        bases.popitem(last=False)
