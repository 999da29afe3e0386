"""The parameter server of one run: ``W_s``, its merge path (read ``W_c`` -> check -> rule -> commit).

Everything that touches parameter arrays runs in the run's merge thread, never on the scheduler's
event loop.  The loop reads :attr:`ParamsServer.head`, an immutable :class:`Head` that the merge
thread replaces as one object after each merge or commit.  The run's retention policy is applied
here too, between merges, once per ``Retention.interval`` or sooner by its ``backlog_bytes``
(:meth:`ParamsServer.collect`).
Commits and retention live in :mod:`vcdask.engine.committing` (a mixin of :class:`ParamsServer`).

Each version's metadata records the run's progress (:class:`~.progress.Progress`: the epochs done, with
the step at which each ended, and the shards merged or given up in the epochs still open), so that a
resumed run knows what was done even after retention removed the versions that did it.
"""

from __future__ import annotations

import logging
import math
import time
import zipfile
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..compress import EncodedUpdate
from ..merge import Arrival, MergeRule, RuleState
from ..params import FlatParams, copies_within
from ..store import Retention
from ..updates import delete_update, read_update, update_gone
from .committing import BASES_KEPT, Committing, Head, trim_bases
from .following import can_grow, grow
from .guard import Guard
from .policy import check_update
from .progress import Progress
from .side import SideThread

#: At most this many merges wait for one commit while more results queue behind them.
FOLD_MAX = 8
#: For a rule that needs each update's base (:meth:`MergeRule.requires`): the parameters after each of the
#: most recent merges are kept in memory, at most this many and at most :data:`RECENT_BYTES` together
#: (never fewer than 2); an older base is read from the store by its version.
RECENT_KEPT = 64
RECENT_BYTES = 1 << 30
#: The stages of the merge path timed in :attr:`ParamsServer.stage_seconds` (for the last 256 merges).
STAGES = ("read", "check", "rule", "commit")

__all__ = ["BASES_KEPT", "Head", "ParamsServer"]

logger = logging.getLogger(__name__)


class ParamsServer(Committing):
    """``W_s`` in memory, the merge counter and the newest committed version.

    Parameters
    ----------
    store : ParamStore
    branch : str
        The run's branch; commits are compare-and-swap on its head, so a second
        writer on the branch is detected, never silently interleaved.
    rule : MergeRule
        The merge rule.
    run_id : str
    commit_every : int or "auto"
        Commit after this many merges (a merge that ``completes`` its epoch commits at once).
    keep_updates : bool
        Keep update objects after their merge is committed.
    max_update_norm : float, optional
        Reject updates further than this from ``W_s``.
    guard : Guard, optional
        Robust merging: screens each pseudo-gradient (:mod:`vcdask.engine.guard`).
    outage_timeout : float
        Seconds to wait through a store outage before giving up.
    retention : Retention, optional
        Which versions of the branch to keep (None: all of them).
    inline_bytes : int
        Parameters of at most this many bytes are also kept packed for a Dask message after each
        commit (:attr:`Head.payload`), so a base can travel with the answer that gives it (0: never).
    drafts : bool
        With such parameters, ``commit_every=1`` and no guard: a merge that is not its epoch's last
        leaves its commit to the caller and packs the new parameters first (:attr:`Head.draft`; the
        merge's answer says ``drafted=True``), so the caller can give them as a base while it commits
        them (:meth:`commit`).
    probe : callable, optional
        ``probe(params, rows=None) -> float``, the training loss of candidate parameters (on fewer rows
        than its own when ``rows`` is given), for a rule that needs ``"loss"`` (:class:`~vcdask.merge.Probe`,
        :class:`~vcdask.merge.Auto`; :meth:`~vcdask.engine.probing.ProbeModel.train_loss`).
    follow : int, optional
        ``rule`` is ``fit``'s default, chosen for this many tasks in flight: as the fleet grows, the
        server moves to the default for the tasks in flight at each merge (the record's ``in_flight``)
        once that is another kind of rule (:mod:`vcdask.engine.following`).  None: the rule stays.
    """

    def __init__(
        self,
        store: Any,
        branch: str,
        rule: MergeRule,
        run_id: str,
        *,
        commit_every: int | str = 1,
        keep_updates: bool = False,
        max_update_norm: float | None = None,
        guard: Guard | None = None,
        outage_timeout: float = 600.0,
        retention: Retention | None = None,
        inline_bytes: int = 0,
        drafts: bool = False,
        probe: Callable[..., float] | None = None,
        follow: int | None = None,
        n_shards: int | None = None,
    ):
        self.store = store
        self.branch = branch
        if not isinstance(rule, MergeRule):
            raise TypeError(f"rule must be a vcdask.merge.MergeRule, got {rule!r}")
        self.rule = rule
        if "loss" in rule.needs and probe is None:
            raise ValueError(f"the {rule.name!r} merge rule needs a probe of the training loss (probe=...)")
        self.probe = probe
        self.follow = follow  # (fit's default: the tasks in flight the rule was chosen for)
        #: the probe kept for a rule the fleet may grow into (:func:`~vcdask.engine.following.grow` hands it over)
        self.spare_probe = probe if follow is not None and can_grow(rule) else None
        self.rule_state = RuleState()
        self.run_id = run_id
        #: ``commit_every="auto"``: commit every merge, or with the last of the results queued behind it
        self.fold = commit_every == "auto"
        self.commit_every = 1 if self.fold else int(commit_every)
        self.keep_updates = keep_updates
        self.max_update_norm = max_update_norm
        self.guard = guard
        self.outage_timeout = outage_timeout
        self.params: FlatParams | None = None
        self.head = Head()
        self.inline_bytes = int(inline_bytes)
        self.drafts = bool(drafts) and self.inline_bytes > 0 and self.commit_every == 1 and not self.fold
        self.drafts = self.drafts and guard is None  # (the guard screens an update against its base version)
        self.uncommitted: list[dict[str, Any]] = []
        self.retention = retention
        #: The oldest step the run's tasks still read (the loop sets it; older is conservative).
        self.in_use_step: int | None = None
        self.keep_from = 0  # retention: the kept versions before this step are pinned (the marker for others)
        self.progress = Progress(n_shards=n_shards)  # (n_shards: an epoch is done once all are merged or skipped)
        self._collected = time.monotonic()
        self._backlog = 0  # bytes of parameters committed since the last collection began
        self.collect_seconds: list[float] = []  # how long each collection took (for benchmarks/storage.py)
        #: Where the merge path's time goes, per stage (recent merges; for benchmarks/merge_path.py): reading
        #: the update, checking it, the rule, and the store's commit (parameters, rule state, snapshot).
        self.stage_seconds: dict[str, deque[float]] = {k: deque(maxlen=256) for k in STAGES}
        self._said_held_back = False
        self._bases: OrderedDict[str, FlatParams] = OrderedDict()  # base versions of compressed updates
        self._recent: OrderedDict[int, FlatParams] = OrderedDict()  # W_s after recent merges, by step (see RECENT_KEPT)
        #: Reads the next queued update ahead and deletes merged ones, off the merge path
        self.side = SideThread(store.files)

    # -- the loop's read-only views (each one attribute read) -----------------------------------
    @property
    def step(self) -> int:
        return self.head.step

    @property
    def version(self) -> str | None:
        """The newest committed version id."""
        return self.head.version

    @property
    def version_step(self) -> int:
        return self.head.version_step

    @property
    def committed(self) -> bool:
        return self.head.committed

    @property
    def folded(self) -> bool:
        """Merges wait for a commit only because more results were queued (see :meth:`merge`)."""
        return self.head.folded

    def stalled(self, after: float = 5.0) -> str | None:
        """Why the run waits for the store, if it does: a failed store request past the store's own
        retries, or one still running after ``after`` seconds."""
        head = self.head  # (one read: the merge thread replaces it as a whole)
        if head.paused:
            return head.paused
        waiting = head.waiting
        if waiting is not None and time.monotonic() - waiting[1] > after:
            return f"waiting {time.monotonic() - waiting[1]:.0f} s for the store ({waiting[0]})"
        return None

    def footprint(self) -> dict[str, int]:
        """Bytes of the parameter-sized arrays the server holds: ``W_s``, the rule's state, the bases of
        compressed updates (all 0 once :meth:`release` ran; while the run goes on, a glimpse of what the
        merge thread holds, for a status view)."""
        params, state = self.params, self.rule_state
        return {
            "params": params.nbytes if params is not None else 0,
            "rule_state": sum(a.nbytes for a in list(state.arrays.values())),
            "bases": sum(b.nbytes for b in [*self._bases.values(), *self._recent.values()]),
        }

    def release(self) -> None:
        """Drop the parameter-sized arrays (``W_s``, the rule's state, the bases, the guard) once the
        run has ended: the scheduler keeps only the run's small records (:attr:`head`, progress)."""
        self.params = None
        self.head = replace(self.head, payload=None, draft=None)
        self.rule_state = RuleState()
        self._bases.clear()
        self._recent.clear()
        self.guard = None
        self.probe = self.spare_probe = None  # (a probe keeps the run's spec: its model and its training rows)
        self.side.close()

    # -- the merge thread -----------------------------------------------------------------------
    def load(self) -> None:
        """Start from the newest version on the branch (with the rule's state if it is this run's)."""
        checkpoint = self.store.read(branch=self.branch)
        self.params = checkpoint.params.clone()
        step = int(checkpoint.metadata.get("step", 0))
        self.head = Head(step, checkpoint.version, step, payload=self.packed())
        meta = checkpoint.metadata
        saved = meta.get("merge", {}).get("name") if isinstance(meta.get("merge"), dict) else None
        if meta.get("run_id") == self.run_id:  # (the fleet had grown: the rule its versions were merged with)
            grow(self, meta.get("merge_in_flight"))
        fresh = self.rule.init_state(self.params)
        if meta.get("run_id") == self.run_id:
            self.progress = Progress.read(meta, self.progress.n_shards)
        if meta.get("run_id") == self.run_id and saved == self.rule.name:  # this run's own version: resume
            # Copies in fresh memory, not views of the state object's buffer (there a tensor is aligned
            # only to its element size): torch.dot's float32 sum depends on its operands' alignment, and
            # the default rule's bound (nesterov._dot), computed on a view, came out an ulp off the
            # uninterrupted run's.  The buffer goes once the views do: one copy at most, for a moment.
            self.rule_state = RuleState(
                arrays={name: flat.clone() for name, flat in self.store.read_state(checkpoint.version).items()},
                scalars={**fresh.scalars, **meta.get("rule_state", {})},
            )
            expected = self.rule.state_arrays(self.params, self.rule_state)
            if not expected <= set(self.rule_state.arrays):  # (a rule may keep more, e.g. sync's round)
                raise ValueError(
                    f"version {checkpoint.version!r} holds {self.rule.name} state "
                    f"{sorted(self.rule_state.arrays)}, expected {sorted(expected)}"
                )
        else:  # a new run (possibly from another run's version): a fresh outer optimizer
            self.rule_state = fresh
        self._recent.clear()
        self._keep_recent()
        self.head = replace(self.head, rule=self.rule.label(self.rule_state))

    def merge(
        self,
        record: dict[str, Any],
        max_staleness: int | None = None,
        completes: bool = False,
        more: bool = False,
        ahead: str | None = None,
    ) -> dict[str, Any]:
        """Merge the update described by ``record`` (epoch, shard, attempt, base_step, update path).

        ``completes``: this merge completes its epoch (it is committed at once, and the epoch's end
        recorded in the run's progress).  ``more``: other results are waiting to be merged; with
        ``commit_every="auto"`` the commit is left to the last of them (up to :data:`FOLD_MAX` merges
        in one version), so a backed-up queue costs one commit, not one per merge.  ``ahead``: the
        path of the update queued next, read on the side thread while this one is merged and committed
        (:class:`~.side.SideThread`), so that a backed-up queue does not wait for each read in turn.

        Returns the history fields of the merge: accepted, alpha, new_version, staleness, version_id;
        or, for an update that fails :func:`~vcdask.engine.policy.check_update` (``max_staleness``: the
        limit in force for this merge, None for none), ``accepted=False`` with the ``reason`` and
        ``fault`` kind — ``W_s`` is then untouched.
        """
        assert self.params is not None, "load() first"
        if grow(self, record.get("in_flight")):  # (the status names the new rule even if this update is rejected)
            self.rule_state = self.rule.init_state(self.params)
            self.head = replace(self.head, rule=self.rule.label(self.rule_state))
        staleness = self.step - record["base_step"]
        t0 = time.perf_counter()
        try:
            path, what = record["update"], f"reading the update of shard {record['shard']}"
            client = self.side.read(
                path, lambda: self._through_outages(lambda: read_update(self.store.files, path), what), ahead
            )
            if isinstance(client, EncodedUpdate):  # W_c - W_base, compressed: add it to its base
                client = client.decode(self._base(client.base_version))
            needs = self.rule.requires(self.rule_state)
            base = self._base_of(record) if "base" in needs else None
        except (ValueError, KeyError, FileNotFoundError, EOFError, zipfile.BadZipFile) as e:
            # unreadable (missing, truncated, not an update, its base gone): rejected, not a crash
            return self._reject(record, staleness, "unreadable", f"unreadable update: {e}")
        t1 = time.perf_counter()
        problem = check_update(
            self.params, client, staleness=staleness, max_staleness=max_staleness, max_norm=self.max_update_norm
        )
        if problem is None and self.guard is not None:
            version = record["base_version"]  # (not ``base``: the rule's base parameters, above)
            steps, shard = int(record.get("steps") or 1), int(record["shard"])
            client, problem = self.guard.screen(version, self._base(version), client, steps, shard)
        if problem is not None:
            return self._reject(record, staleness, *problem)
        t2 = time.perf_counter()
        n = int(record.get("n_samples", 1))
        seconds = task_seconds(record)
        probe = self.probe if "loss" in needs else None
        arrival = Arrival(record["epoch"], staleness, n, base=base, loss=probe, seconds=seconds)
        outcome = self.rule.apply(self.params, client, self.rule_state, arrival)
        for stage, seconds in zip(STAGES, (t1 - t0, t2 - t1, time.perf_counter() - t2), strict=False):
            self.stage_seconds[stage].append(seconds)  # (commit: in commit())
        self.head = replace(self.head, step=self.step + 1, rule=self.rule.label(self.rule_state))
        self._keep_recent()
        self.uncommitted.append(record)
        self._progress(record, completes)
        due = len(self.uncommitted) >= self.commit_every
        if completes or (due and not (self.fold and more and len(self.uncommitted) < FOLD_MAX)):
            draft = self.packed() if self.drafts and not completes else None
            if draft is None:
                self.commit()
            else:  # the caller gives it as a base, then commits it (``version_id`` is None till then)
                self.head = replace(self.head, draft=draft)
        self.head = replace(self.head, folded=due and not self.committed and self.head.draft is None)
        out = {
            "accepted": True,
            "alpha": outcome.get("alpha"),
            "new_version": self.step,
            "staleness": self.step - 1 - record["base_step"],
            "version_id": self.version if self.committed else None,
        }
        if self.head.draft is not None:
            out["drafted"] = True  # the caller commits it (:meth:`commit`), then knows ``version_id``
        return out

    def _base(self, version: str) -> FlatParams:
        """The parameters of ``version`` (a compressed update's base): kept since this server committed
        them, or read from the store (then kept: the next updates are often based on it too)."""
        params = self._bases.get(version)
        if params is None:
            params = self._through_outages(lambda: self.store.read(version).params, f"reading version {version}")
            self._bases[version] = params
        self._bases.move_to_end(version)
        trim_bases(self._bases, params.nbytes)
        return params

    def _keep_recent(self) -> None:
        """Keep ``W_s`` at this step, for the rule's later updates based on it (:data:`RECENT_KEPT`); drop the
        kept states and the probe once the rule needs them no more (:meth:`MergeRule.requires`).  With drafts,
        a run on fit's default that may still grow into ``"auto"`` keeps them too."""
        needs = self.rule.requires(self.rule_state)
        if "loss" not in needs:
            self.probe = None  # (a rule that chose not to probe: its model copy and rows go)
        small = self.params is not None and self.params.nbytes <= self.inline_bytes  # (only those have drafts)
        if self.spare_probe is not None and self.drafts and small:  # (may grow into a rule that needs each
            needs = needs | {"base"}  # update's base, and a draft's is kept nowhere else)
        if self.params is None or "base" not in needs:
            self._recent.clear()  # (a rule that chose not to need them any more)
            return
        self._recent[self.step] = self.params.clone()
        kept = copies_within(RECENT_KEPT, RECENT_BYTES, self.params.nbytes)
        while len(self._recent) > kept:
            self._recent.popitem(last=False)

    def _base_of(self, record: dict[str, Any]) -> FlatParams:
        """The parameters the update of ``record`` was trained from: kept by step, or read by version."""
        params = self._recent.get(int(record["base_step"]))
        if params is not None:
            return params
        version = record.get("base_version")
        if version is None:  # a draft's base, no longer kept (the server restarted): nothing to read
            raise KeyError(f"its base (step {record['base_step']}) was never committed and is no longer kept")
        return self._base(version)

    def _progress(self, record: dict[str, Any], completes: bool) -> None:
        epoch, shard, attempt = int(record["epoch"]), int(record["shard"]), int(record["attempt"])
        self.progress.merged(epoch, shard, attempt, self.step, completes)

    def note_skip(self, epoch: int, shard: int, end_step: int | None) -> None:
        """(epoch, shard) was given up (``on_shard_failure="skip"``); ``end_step``: the step at which that
        completed its epoch, if it did.  Stored with the next commit (a run that ends before one keeps it in
        its record: :func:`~.end.record`)."""
        self.progress.skip(epoch, shard, end_step, self.step)

    def _reject(self, record: dict[str, Any], staleness: int, fault: str, reason: str) -> dict[str, Any]:
        if update_gone("rejected", self.keep_updates):
            delete_update(self.store.files, record["update"])
        return {"accepted": False, "staleness": staleness, "reason": reason, "fault": fault}


def task_seconds(record: dict[str, Any]) -> float | None:
    """How long a task of ``record``'s worker takes, as the run sees it: reading, training at the worker's
    pace (its steps at their median time: a task's first steps also pay warm-up) and uploading; not its
    wait for earlier merges.  None when the record says nothing of it (a time that is not a finite number,
    e.g. the upload of a record read back from the store, counts as unknown)."""

    def known(key: str) -> float | None:
        value = record.get(key)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 else None

    step, steps = known("step_seconds"), record.get("steps")
    train = step * int(steps) if step is not None and steps else known("train_seconds")
    if train is None:
        return None
    return train + (known("read_seconds") or 0.0) + (known("upload_seconds") or 0.0)
