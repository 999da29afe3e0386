"""Which shard goes out next, and where: epoch queues, sticky homes, attempts, returned work.

Pure bookkeeping (the event loop only): the run asks for the next shard when a slot frees up,
and for where to place a copy; this module never submits anything itself.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from typing import Any

__all__ = ["Dispatcher"]


class Dispatcher:
    """The shard queues of one run.

    Each epoch's shards are queued in a seeded random order (:meth:`order`) when dispatch reaches that epoch.
    A freed worker is given a shard it trained before when one is queued (it caches those rows:
    the paper's "sticky files").

    Parameters
    ----------
    n_shards, max_epochs, seed : int
    """

    def __init__(self, n_shards: int, max_epochs: int, seed: int):
        self.n_shards = n_shards
        self.max_epochs = max_epochs
        self.seed = seed
        self.queue: dict[int, list[int]] = {}
        self.epoch = 0  # the epoch dispatch has reached
        self.attempts: dict[tuple[int, int], int] = {}  # copies submitted (they name their keys)
        self.failures: dict[tuple[int, int], int] = {}  # lost, timed out or rejected copies
        self.unfit: dict[tuple[int, int], int] = {}  # copies lost to workers without the run's device
        self.home: dict[int, str] = {}  # shard -> the worker that last merged it (it caches its rows)
        # shards to send again: their copy failed on the store, or no usable worker was there to take it
        self.returned: list[tuple[int, int]] = []
        self.parked_validations: list[tuple[str | None, int, int]] = []  # (version, step, retry) to send again
        # each shard's place in the order the run handed them out, over all epochs (a global learning-rate
        # schedule's clock: vcdask.lr_schedules); the shards of an epoch handed out so far
        self.positions: dict[tuple[int, int], int] = {}
        self.issued: dict[int, int] = {}
        self.non_finite: dict[int, dict[str, set[int]]] = {}  # shard -> worker -> epochs its update was NaN/inf

    def order(self, epoch: int) -> list[int]:
        """``epoch``'s shards in their seeded order: from the seed and the epoch alone, so that a resumed run
        hands out what is left of an epoch, and every later epoch, in the order the run would have."""
        order = list(range(self.n_shards))
        random.Random(f"vcdask.order:{self.seed}:{epoch}").shuffle(order)
        return order

    def restore(self, merged: dict[int, set[int]], attempts: dict[tuple[int, int], int], last_epoch: int) -> None:
        """Queue what a resumed run has left of epochs ``1..last_epoch`` (attempt numbers go on), in each
        epoch's own order (:meth:`order`)."""
        self.attempts = dict(attempts)
        for epoch in range(1, last_epoch + 1):
            todo = [s for s in self.order(epoch) if s not in merged.get(epoch, ())]
            self.queue[epoch] = todo
            self.issued[epoch] = self.n_shards - len(todo)  # merged before: their places are taken

    def take(self, epoch: int, shard: int) -> None:
        """(epoch, shard) is being handled outside the queue (an upload a resumed run merges)."""
        queue = self.queue.get(epoch, [])
        if shard in queue:
            queue.remove(shard)

    def next_shard(self, worker: str | None = None) -> tuple[int, int] | None:
        """The next (epoch, shard) to train, preferring a shard whose home is ``worker``; None when
        every epoch up to ``max_epochs`` has been handed out."""
        while not self.queue.get(self.epoch):
            if self.epoch >= self.max_epochs:
                return None
            self.epoch += 1
            if self.epoch not in self.queue:  # (a resumed run has its earlier queues already)
                self.queue[self.epoch] = self.order(self.epoch)
        queue = self.queue[self.epoch]
        pick = next((s for s in queue if worker is not None and self.home.get(s) == worker), queue[0])
        queue.remove(pick)
        self.position(self.epoch, pick)
        return self.epoch, pick

    def position(self, epoch: int, shard: int) -> int:
        """(epoch, shard)'s place in the order the run handed out its shards (0-based, over all epochs):
        given when it is first handed out, kept by the copies that replace it."""
        key = (epoch, shard)
        if key not in self.positions:
            n = self.issued.get(epoch, 0)
            self.issued[epoch] = n + 1
            self.positions[key] = (epoch - 1) * self.n_shards + min(n, self.n_shards - 1)
        return self.positions[key]

    def exhausted(self) -> bool:
        """Whether nothing is left to hand out."""
        return self.epoch >= self.max_epochs and not self.queue.get(self.epoch)

    def next_attempt(self, epoch: int, shard: int) -> int:
        """The attempt number of a new copy of (epoch, shard) (never reused: it names the key)."""
        attempt = self.attempts.get((epoch, shard), 0)
        self.attempts[(epoch, shard)] = attempt + 1
        return attempt

    def last_attempt(self, epoch: int, shard: int) -> int:
        return self.attempts.get((epoch, shard), 1) - 1

    def park(self, epoch: int, shard: int) -> None:
        """Hold (epoch, shard) back until it can be placed; the run sends it first once it can."""
        if (epoch, shard) not in self.returned:
            self.returned.append((epoch, shard))

    def failed(self, epoch: int, shard: int, count: bool = True) -> int:
        """A copy of (epoch, shard) failed; return the shard's failures in its epoch (``count=False``:
        not its fault, e.g. a copy that never started or fell behind)."""
        failures = self.failures[(epoch, shard)] = self.failures.get((epoch, shard), 0) + int(count)
        return failures

    @staticmethod
    def placement(
        home: str | None,
        usable: list[str],
        n_connected: int,
        avoid: Collection[str] = (),
        busy: Collection[str] = (),
    ) -> dict[str, Any] | None:
        """Dask placement restrictions for a new copy (``client.submit(..., **placement)``); None when
        no worker is usable (every connected one excluded or draining, or none connected).

        Strict (``workers=usable``) when some connected worker must not get it (excluded, draining,
        the one it is moved away from, or one stuck on a late copy: ``avoid``); else sticky to the
        shard's home, free to move.  If every usable worker is to be avoided, any usable one will do.

        A home that is ``busy`` (it already holds its share of copies, running or queued there) is no
        home for this copy: the copy would wait behind the others while another worker sits idle, and
        behind a frozen worker it would wait for as long as that worker's deadline.  The copy then goes
        to the workers that are not busy, free to move: left unrestricted, Dask queues such tasks and
        hands them to any worker with a free slot by its own count (``worker-saturation`` gives a
        one-thread worker two), the frozen one included.

        With no usable worker there is no placement: ``workers=[]`` would be no restriction at all
        to Dask, and the copy would go to an excluded or draining worker.  The run parks the copy
        (:meth:`park`) until a usable worker connects.
        """
        if not usable:
            return None
        allowed = [a for a in usable if a not in avoid] or usable
        if len(allowed) < n_connected:
            return {"workers": allowed}
        if home in allowed and home not in busy:
            return {"workers": [home], "allow_other_workers": True}
        free = [a for a in allowed if a not in busy]
        if busy and free:
            return {"workers": free, "allow_other_workers": True}
        return {}
