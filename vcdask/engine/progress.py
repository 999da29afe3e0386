"""A run's progress, as each of its versions records it (the ``progress`` entry of the version's metadata).

It says what a resumed run must not train again, even after retention removed the versions that merged
it: the epochs done (with the step of the version that ended each), and in the epochs still open the
shards merged (with their attempt numbers, which are never used again) and the shards given up
(``on_shard_failure="skip"``).  Retention keeps the versions that ended the epochs done
(:func:`vcdask.store.select`), whatever epoch their own last merge belonged to.

Owned by the run's merge thread (:class:`~vcdask.engine.params_server.ParamsServer`): the loop tells it
of a skip through the merge lane, in order with the merges, so the next commit stores it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Progress"]


@dataclass
class Progress:
    """What a run has merged and given up, in the form its versions' metadata stores.

    Attributes
    ----------
    done : list of [epoch, step]
        Each epoch done, with the step of the version that ended it (by its last merge or skip).
    open : list of [epoch, shard, attempt]
        The shards merged in the epochs not done yet.
    skipped : list of [epoch, shard]
        The shards given up in the epochs not done yet.
    n_shards : int, optional
        Shards an epoch has (not stored): once the merged and given-up shards of an epoch cover them all,
        the epoch is done, whichever of the two came last (a shard given up while the merge of the
        epoch's last other shard was running ends the epoch there, though neither alone knew it).
    """

    done: list[list[int]] = field(default_factory=list)
    open: list[list[int]] = field(default_factory=list)
    skipped: list[list[int]] = field(default_factory=list)
    n_shards: int | None = field(default=None, compare=False)

    @classmethod
    def read(cls, metadata: Mapping[str, Any], n_shards: int | None = None) -> Progress:
        """The progress a version's metadata (or a run's record) records; empty for a version without one
        (an older vcdask's)."""
        saved = metadata.get("progress") or {}
        lists = {k: [[int(x) for x in entry] for entry in saved.get(k, ())] for k in ("done", "open", "skipped")}
        return cls(**lists, n_shards=n_shards)

    def as_metadata(self) -> dict[str, list[list[int]]]:
        """A copy for a version's metadata (JSON: lists of ints)."""
        return {
            "done": [list(e) for e in self.done],
            "open": [list(e) for e in self.open],
            "skipped": [list(e) for e in self.skipped],
        }

    def done_epochs(self) -> set[int]:
        return {epoch for epoch, _ in self.done}

    def merged(self, epoch: int, shard: int, attempt: int, step: int, completes: bool = False) -> None:
        """(epoch, shard) merged (its ``attempt``) into the version at ``step``; ``completes``: the run knew
        it ends the epoch (it also ends once the epoch's shards are all merged or given up).

        A copy of a shard given up while it was being merged counts as merged (``W_s`` holds it); one of
        an epoch already done changes nothing."""
        if epoch in self.done_epochs():
            return
        self.skipped = [e for e in self.skipped if e != [epoch, shard]]
        self.open.append([epoch, shard, attempt])
        if completes or self._covered(epoch):
            self._end(epoch, step)

    def skip(self, epoch: int, shard: int, end_step: int | None, step: int) -> None:
        """(epoch, shard) given up; ``end_step``: the step at which the run saw that complete its epoch, if
        it did; ``step``: the newest merge's (where the epoch ends if the shards cover it now, though the run
        saw the skip before that merge)."""
        if epoch in self.done_epochs():
            return
        if [epoch, shard] not in self.skipped and [epoch, shard] not in [e[:2] for e in self.open]:
            self.skipped.append([epoch, shard])
        if end_step is not None:
            self._end(epoch, end_step)
        elif self._covered(epoch):
            self._end(epoch, step)

    def close_covered(self, step: int) -> None:
        """End, at ``step``, every open epoch whose shards are all merged or given up (a store written before an
        epoch ended this way was left with such an epoch, which nothing would end)."""
        for epoch in sorted({e[0] for e in [*self.open, *self.skipped]} - self.done_epochs()):
            if self._covered(epoch):
                self._end(epoch, step)

    def _covered(self, epoch: int) -> bool:
        if self.n_shards is None:
            return False
        shards = {e[1] for e in self.open if e[0] == epoch} | {e[1] for e in self.skipped if e[0] == epoch}
        return len(shards) >= self.n_shards

    def _end(self, epoch: int, step: int) -> None:
        self.open = [e for e in self.open if e[0] != epoch]
        self.skipped = [e for e in self.skipped if e[0] != epoch]
        self.done.append([epoch, step])
