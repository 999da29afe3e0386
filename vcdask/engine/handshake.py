"""The base handshake: which version a shard task trains from, and when it may have it.

A worker gets its next shard as soon as its result is back, before that result is merged.  The loop
counts the shard results it has taken (``arrived``) and those the merge path has finished with
(``settled``: merged and committed, or turned down); a task that asks for its base
(``vcdask_base``, or the answer to its worker's hand-over: ``vcdask_finished``) waits until the results
taken before it asked are settled, so it trains from a version holding its worker's own last update
(while the merge path goes on: at most :func:`~.policy.base_wait` for each of its steps, and twice that
in all).
:class:`Handshake` waits on the counters (the run's core keeps them); :class:`Bases` answers the tasks
(the event loop only).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from . import policy
from .committing import Head

if TYPE_CHECKING:
    from .core import RunState

__all__ = ["Bases", "Handshake"]


class Handshake:
    """The results a run took and settled, and the tasks waiting for them (the event loop only).

    Parameters
    ----------
    counts : object, optional
        Where the two counters live (``arrived`` and ``settled``: the run's
        :class:`~vcdask.engine.core.RunState`, whose core counts them); its own by default.
    """

    def __init__(self, counts: Any = None) -> None:
        self.counts = counts if counts is not None else SimpleNamespace(arrived=0, settled=0)
        self._wake = asyncio.Event()

    @property
    def arrived(self) -> int:
        """Shard results taken from the workers."""
        return int(self.counts.arrived)

    @arrived.setter
    def arrived(self, value: int) -> None:
        self.counts.arrived = value

    @property
    def settled(self) -> int:
        """How many of them the merge path has finished with (merged and committed, or turned down)."""
        return int(self.counts.settled)

    @settled.setter
    def settled(self, value: int) -> None:
        self.counts.settled = value

    def note_settled(self) -> None:
        """Wake the tasks waiting in :meth:`settled_through` (they check again what they wait for)."""
        self._wake.set()
        self._wake = asyncio.Event()

    def through(self, head: Head, commit_every: int, arrived: int) -> bool:
        """Whether a task that asks for its base now may have it, with ``arrived`` results to wait for
        and the server at ``head``."""
        # a draft (:attr:`~.committing.Head.draft`) is the merge of the result after the settled ones,
        # being committed: a small model's base goes out as that draft
        if head.draft is not None and self.settled + 1 >= arrived:
            return True
        return self.settled >= arrived and (head.step == head.version_step or commit_every > 1)

    def _progress(self, head: Head) -> tuple[int, int, int]:
        """Where the merge path is: results settled, the step merged, the step committed."""
        return self.settled, head.step, head.version_step

    async def settled_through(
        self,
        head: Callable[[], Head],
        commit_every: int,
        arrived: int,
        timeout: float,
        done: asyncio.Event,
        most: float | None = None,
    ) -> bool:
        """Wait until the first ``arrived`` results are merged and committed (or turned down), or merged
        and being committed as a draft; whether they are.  ``head`` reads the server's head; ``done``:
        the run has ended (nothing more will settle).

        ``timeout`` bounds the wait for the merge path's *next* step (a result settled, a version
        committed), not the whole wait: a task behind a queue of merges that keep coming waits its turn,
        as the merges set the run's pace then (a worker let go on would only queue another, staler
        result), and one behind a merge path that stops (a stuck merge, a store outage) goes on after
        ``timeout``.  ``most``: the longest the whole wait may take (unbounded by default)."""
        start = time.monotonic()
        end = math.inf if most is None else start + most
        deadline = min(start + timeout, end)
        progress = self._progress(head())
        while not self.through(current := head(), commit_every, arrived):
            now = time.monotonic()
            if self._progress(current) != progress:  # the merges go on: so does the wait
                progress, deadline = self._progress(current), min(now + timeout, end)
            if deadline <= now or done.is_set():
                return False
            try:
                await asyncio.wait_for(self._wake.wait(), deadline - now)
            except TimeoutError:
                return False
        return True


class Bases:
    """What a run answers a shard task that asks which version to train from.

    Parameters
    ----------
    state : RunState
        The run's core state (its task table, its counters); read here, changed only in the copy's
        own record (``step``, ``based``), as a start is.
    handshake : Handshake
    head : callable
        The server's head, read now (:attr:`~.lane.MergeLane.head`).
    commit_every : int
    done : asyncio.Event
        Set once the run has ended.
    """

    def __init__(
        self, state: RunState, handshake: Handshake, head: Callable[[], Head], commit_every: int, done: asyncio.Event
    ):
        self.state, self.handshake, self.head, self.commit_every, self.done = state, handshake, head, commit_every, done

    async def base_for(self, key: str, worker: str | None = None) -> dict[str, Any] | None:
        """The version a shard task that is ready to train should start from: the newest committed one,
        once the results that came back before it asked are merged (waiting while the merge path goes
        on, at most :func:`~vcdask.engine.policy.base_wait` for each of its steps and
        :data:`~vcdask.engine.policy.BASE_WAIT_STEPS` times that in all).

        A task asks once it has read the run's spec and its rows, so the time a copy waited in a queue
        or spent warming up a cold worker is not counted as staleness (a healthy run's first updates
        were once rejected as stale for it).  A worker gets its next shard as soon as its result is back,
        before that result is merged: without the wait, its next task would train from the version just
        before its own update, every time (half of the work lost with ``alpha=0``; one step staler with
        every rule).  With ``vcdask.worker.overlap="delta"`` the worker does not wait for this answer: its
        next task trains meanwhile and corrects its weights once the answer is there (:mod:`vcdask.overlap`);
        with ``"newest"`` the answer does not wait for the merges due.

        Returns ``{"version": ..., "step": ...}``, or ``{"abandon": True}`` for a copy the run no longer
        waits for: cancelled, or a finished one that Dask runs again because the worker holding its result
        died (the run read that result from the store, :mod:`.results`); it would train for nothing and
        overwrite the update the run merges.  A base also has

        - ``"params"``: its parameters packed by :func:`vcdask._wire.pack`, when they are at most
          ``vcdask.worker.inline-base-bytes``; ``"version"`` is None for such parameters given as they
          were merged, while the merge thread commits them as the version of ``"step"``
          (``vcdask.worker.base-before-commit``);
        - ``"fraction"``, with ``speed_adaptive``: the share of its shard's batches the task trains on ``worker``.
        """
        state, hs = self.state, self.handshake
        task = state.tasks.records.get(key)
        if task is None:
            return {"abandon": True}
        if task.kind != "update":
            return None
        waits = state.spec.overlap != "newest"  # (vcdask.overlap) "newest": the head as it is, without the merges due
        if waits and hs.settled < hs.arrived and not hs.through(self.head(), self.commit_every, hs.arrived):
            wait = policy.base_wait(state.ledger.shard_seconds)
            await hs.settled_through(
                self.head, self.commit_every, hs.arrived, wait, self.done, most=policy.BASE_WAIT_STEPS * wait
            )
            task = state.tasks.records.get(key)
            if task is None:
                return {"abandon": True}
        head = self.head()
        base: dict[str, Any]
        if head.draft is not None:  # merged, being committed: its version id does not exist yet
            base = {"version": None, "step": head.step, "params": head.draft}
        else:
            base = {"version": head.version, "step": head.version_step}
            if head.payload is not None:  # a small model: no store read for the worker
                base["params"] = head.payload
        task.step, task.based = base["step"], True
        worker = worker or task.worker
        if state.spec.speed_adaptive and worker:  # the share of its shard's batches a task there trains
            base["fraction"] = state.pool.work_fraction(worker)
        return base

    async def next_base(self, key: str, worker: str) -> dict[str, Any] | None:
        """The base of shard copy ``key``, just sent to ``worker`` to run there next, for the answer to the
        hand-over of the task finishing there: what :meth:`base_for` would answer the copy once it
        starts, decided now, so a warm worker sends one message per task, not two.

        None when the copy started elsewhere, was given its base, or was given up meanwhile, or when its
        shard's home is another worker (``worker`` reads its rows first, a while maybe: the copy asks for
        its base itself once it has them).  The caller records the copy as started on ``worker`` unless it
        said so itself: it starts as soon as the hand-over returns, or (``vcdask.worker.overlap="delta"``)
        it started already, training from its worker's own last update while this answer waits for the merge.
        """

        def taken(task: Any) -> bool:
            return task.started is not None and (task.worker != worker or task.based)

        tasks = self.state.tasks.records
        task = tasks.get(key)
        if task is None or task.kind != "update" or taken(task):
            return None
        if self.state.dispatch.home.get(task.shard) != worker:  # it reads its rows first: it asks once it has them
            return None
        base = await self.base_for(key, worker)
        task = tasks.get(key)
        if base is None or "abandon" in base or task is None or (task.started is not None and task.worker != worker):
            return None
        return base
