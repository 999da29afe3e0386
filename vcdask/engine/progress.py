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
    """

    done: list[list[int]] = field(default_factory=list)
    open: list[list[int]] = field(default_factory=list)
    skipped: list[list[int]] = field(default_factory=list)

    @classmethod
    def read(cls, metadata: Mapping[str, Any]) -> Progress:
        """The progress a version's metadata records (empty for a version without one: an older vcdask's)."""
        saved = metadata.get("progress") or {}
        lists = {k: [[int(x) for x in entry] for entry in saved.get(k, ())] for k in ("done", "open", "skipped")}
        return cls(**lists)

    def as_metadata(self) -> dict[str, list[list[int]]]:
        """A copy for a version's metadata (JSON: lists of ints)."""
        return {
            "done": [list(e) for e in self.done],
            "open": [list(e) for e in self.open],
            "skipped": [list(e) for e in self.skipped],
        }

    def done_epochs(self) -> set[int]:
        return {epoch for epoch, _ in self.done}

    def merged(self, epoch: int, shard: int, attempt: int, end_step: int | None) -> None:
        """(epoch, shard) merged (its ``attempt``); ``end_step``: the step that completed its epoch, if it did.

        A copy of a shard given up while it was being merged counts as merged (``W_s`` holds it); one of
        an epoch already done changes nothing."""
        if epoch in self.done_epochs():
            return
        self.skipped = [e for e in self.skipped if e != [epoch, shard]]
        if end_step is None:
            self.open.append([epoch, shard, attempt])
        else:
            self._end(epoch, end_step)

    def skip(self, epoch: int, shard: int, end_step: int | None) -> None:
        """(epoch, shard) given up; ``end_step``: the step at which that completed its epoch, if it did."""
        if epoch in self.done_epochs():
            return
        if end_step is None:
            if [epoch, shard] not in self.skipped:
                self.skipped.append([epoch, shard])
        else:
            self._end(epoch, end_step)

    def _end(self, epoch: int, step: int) -> None:
        self.open = [e for e in self.open if e[0] != epoch]
        self.skipped = [e for e in self.skipped if e[0] != epoch]
        self.done.append([epoch, step])
