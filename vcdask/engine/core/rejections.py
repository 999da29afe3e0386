"""Updates that failed their checks: who is blamed, when a shard's data is (non-finite updates from two
workers), and what to say when the training likely is (every worker's updates non-finite, nothing merged).

Functions of the :class:`~.state.RunState`; split from :mod:`.failures`, whose :func:`~.failures.blame`,
:func:`~.failures.give_up` and :func:`~.failures.retry_or_give_up` they use.
"""

from __future__ import annotations

import logging

from .failures import blame, give_up, retry_or_give_up
from .messages import Cancel
from .state import RunState

__all__ = ["diverging", "rejected"]

logger = logging.getLogger(__name__)


def rejected(state: RunState, epoch: int, shard: int, worker: str, reason: str, fault: str | None) -> None:
    """The update of (epoch, shard) from ``worker`` failed its checks.

    A shard whose updates came back non-finite from two workers is the data's doing (or the loss's on
    it, or a learning rate the training diverges at), not theirs: the workers are not blamed (each was
    blamed once for it, and is forgiven), and the shard is given up at once, naming its samples, in this
    epoch and in any other whose copy of it already came back non-finite (its re-issued copies are
    cancelled).  A worker is blamed once for each shard it sent NaN for: not again for the same shard in
    another epoch, nor in the same one (the only worker, sent the copy again, as a run on one worker does)
    once it has merged other shards.  So one shard's data never excludes a worker that trains the rest (the
    shard fails its attempts, then ``on_shard_failure`` applies); a worker that has merged nothing is blamed
    for each NaN (excluded, the run waits for another), and one that sends NaN for every shard is excluded."""
    state.ledger.set_shard(epoch, shard, "rejected")
    logger.warning(
        "run %s: rejected the update of shard %d, epoch %d from %s: %s", state.id, shard, epoch, worker, reason
    )
    if fault == "non-finite":
        seen = state.dispatch.non_finite.setdefault(shard, {})
        data_known = len(seen) >= 2  # the data is blamed already: nobody is
        earlier = seen.setdefault(worker, set())
        # blamed the first time only: again in another epoch, or in the same one from a worker that merges other
        # shards (the data's doing); a worker that has merged nothing is blamed each time (it may be broken)
        again = bool(earlier) and (epoch not in earlier or state.pool.record(worker).merged > 0)
        earlier.add(epoch)
        if len(seen) >= 2:
            if not data_known:
                for other in set(seen) - {worker}:
                    state.pool.forgive(other, "rejected")
            _data_given_up(state, epoch, shard, seen)
            return
        if again:  # the same worker, the same shard: counted against it once
            retry_or_give_up(state, epoch, shard, reason, avoid=worker)
            return
    if fault not in ("stale", "unreadable"):  # not the worker's fault: its base was old / the store
        blame(state, worker, "rejected", reason)
    # an update that came back too stale is the pace's doing, not the shard's: re-issue, uncounted
    retry_or_give_up(state, epoch, shard, reason, avoid=worker, count=fault != "stale")


def diverging(state: RunState) -> str | None:
    """What to say of a run that has merged nothing and whose connected workers are all excluded for sending
    only non-finite updates; else None.  It waits for another worker (a broken device sends NaN too, and a good
    worker may join: tests/test_chaos.py), but the likelier cause is the training's, and the pause and the run's
    error name it rather than only the workers."""
    pool = state.pool
    if pool.usable() or any(state.ledger.merged.values()) or not pool.connected:
        return None
    sent_nan = {w for seen in state.dispatch.non_finite.values() for w in seen}
    if not all(a in sent_nan and pool.record(a).excluded for a in pool.connected):
        return None
    n = len(pool.connected)
    return (
        f"{'every' if n > 1 else 'the only'} worker sent only non-finite (NaN/inf) updates and nothing was merged: "
        "the likelier cause is the training, not the workers (a learning rate it diverges at: fit's lr= or its "
        "schedule's warm-up; or a loss or train_step that gives NaN/inf on the data); a run that trains with a "
        "lower lr on these workers rules them out"
    )


def _data_given_up(state: RunState, epoch: int, shard: int, seen: dict[str, set[int]]) -> None:
    """Give ``shard`` up for its data in ``epoch`` and in every epoch where it came back non-finite, unless
    a copy of it in ``epoch`` is still out (it comes back NaN too, or merges)."""
    start, stop = state.spec.shards.bounds(shard)
    why = (
        f"its updates were non-finite (NaN/inf) on {len(seen)} workers ({', '.join(sorted(seen))}): "
        f"the data of samples {start}-{stop - 1} (training rows, after any hold-out), the loss on "
        "them, or a learning rate the training diverges at"
    )
    for e in sorted(set().union(*seen.values())):
        if state.ledger.done(e, shard) or (e == epoch and state.tasks.copy_running(e, shard)):
            continue
        unstarted = state.tasks.unstarted_copies(e, shard)
        if unstarted:  # (one already running is left to finish: it is recorded as late)
            state.out.append(Cancel(unstarted))
        give_up(state, e, shard, f"shard {shard} of epoch {e} is given up: {why}")
