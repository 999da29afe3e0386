"""The boundary between a run's event loop and its merge thread.

:class:`MergeLane` owns the run's merge thread (one worker thread: calls run in the order they were
made) and every call the loop makes into it: loading ``W_s``, merging a result, committing, applying
the retention policy, and whatever else must run in order with them (writing the run's record,
reading back what a resumed run merged).  What the loop knows of the other side comes back in two
ways only: each call's return value, and the server's :class:`~.committing.Head`, one immutable value
the merge thread replaces as a whole (the step, the newest version, a draft base, folded merges, a
store outage).  What the loop tells the merge thread (the oldest version its tasks still read, for
retention) travels as an argument of the call that needs it, never as an attribute set across threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from .. import config
from . import end
from .committing import Head
from .guard import Guard
from .params_server import ParamsServer
from .probing import training_probe

if TYPE_CHECKING:
    from ..spec import RunSpec

__all__ = ["MergeLane", "server_for"]

T = TypeVar("T")


class MergeLane:
    """The merge thread of one run and the loop's calls into it.

    Parameters
    ----------
    server : ParamsServer
        ``W_s`` and its merge path; touched only from this lane's thread once the run has started.
    name : str
        The thread's name (``vcdask-merge-<run>``), as seen in a profiler or a stack dump.
    """

    def __init__(self, server: ParamsServer, name: str):
        self.server = server
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)

    @property
    def head(self) -> Head:
        """Where the server stands (one attribute read)."""
        return self.server.head

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the merge thread, in order with the merges (the only thread that touches ``W_s``)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def load(self) -> None:
        """``W_s`` from the newest version of the run's branch."""
        await self.call(self.server.load)

    async def merge(
        self,
        record: dict[str, Any],
        *,
        completes: bool,
        max_staleness: int | None,
        more: bool,
        in_use_step: int,
        ahead: str | None = None,
    ) -> dict[str, Any]:
        """Merge one shard result (:meth:`ParamsServer.merge`); ``in_use_step``: the oldest version the
        run's tasks still read, which a collection between merges keeps; ``ahead``: the update queued
        next, read while this one is merged."""
        return await self.call(self._merge, record, completes, max_staleness, more, in_use_step, ahead)

    def _merge(
        self,
        record: dict[str, Any],
        completes: bool,
        max_staleness: int | None,
        more: bool,
        in_use_step: int,
        ahead: str | None,
    ) -> dict[str, Any]:
        self.server.in_use_step = in_use_step  # (in the merge thread: it is the only reader)
        return self.server.merge(record, max_staleness=max_staleness, completes=completes, more=more, ahead=ahead)

    async def commit(self) -> None:
        """Commit the merges not yet in a version (a no-op when there are none)."""
        await self.call(self.server.commit)

    async def drain(self) -> None:
        """Wait for the merge path's side thread (its reads ahead and deletes of merged updates)."""
        await self.call(self.server.side.drain)

    async def collect(self, *, final: bool, in_use_step: int) -> None:
        """Apply the run's retention policy (:meth:`ParamsServer.collect`)."""
        await self.call(self._collect, final, in_use_step)

    def _collect(self, final: bool, in_use_step: int) -> None:
        self.server.in_use_step = in_use_step
        self.server.collect(final)

    async def write_record(
        self, store: Any, run_id: str, make: Callable[[], dict[str, Any]], *, strict: bool = False
    ) -> None:
        """Write the run's record ``make()`` builds (in the merge thread, in order with the merges), with where
        the merge thread stands: its step, and its progress with the version it goes with (every merge
        committed), which a resume takes while that version is the branch's newest (:func:`.end.progress_of`).
        ``strict``: a failure is raised, else logged (the run goes on)."""

        def tracked() -> dict[str, Any]:
            head = self.server.head
            on = head.version if head.committed else None  # (merges not in a version: what they did is not kept)
            return {**make(), "step": head.step, "progress": self.server.progress.as_metadata(), "progress_on": on}

        if strict:
            await self.call(lambda: end.write_record(store, run_id, tracked()))
        else:
            await self.call(end.save_record, store, run_id, tracked)

    def shutdown(self) -> None:
        """Let the thread go once its last call is done (the run has ended)."""
        self._executor.shutdown(wait=False)


def server_for(spec: RunSpec) -> ParamsServer:
    """The parameter server of the run ``spec`` describes (``W_s`` is loaded later, in its merge thread)."""
    res = spec.resilience
    return ParamsServer(
        spec.store,
        spec.branch,
        spec.merge,
        spec.run_id,
        commit_every=spec.commit_every,
        keep_updates=spec.keep_updates,
        max_update_norm=res.max_update_norm,
        guard=Guard(spec) if Guard.wanted(spec) else None,
        outage_timeout=res.store_outage_timeout,
        retention=spec.retention,
        inline_bytes=config.get("worker.inline-base-bytes"),
        # (a compressed update is decoded on its base version: its id must be known to the worker)
        drafts=bool(config.get("worker.base-before-commit")) and spec.compression is None,
        probe=training_probe(spec),
        follow=spec.merge_in_flight,  # (fit's default rule follows a fleet that grows)
        n_shards=spec.shards.n_shards,
    )
