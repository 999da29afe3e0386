"""How a worker's next shard meets the merge of its last one (``vcdask.worker.overlap``).

A worker hands its update ``W_c`` to the run, and the run merges it into the server's parameters.
What the worker's next task trains from is a choice between time and what each step learns:

``"delta"`` (the default)
    The next task starts at once, from the worker's own ``W_c``, while the run merges it.  When the
    merged version that holds the update arrives (the hand-over's answer, fetched in a thread), the
    task corrects its weights by ``merged - W_c`` between two steps (hivemind's delta rule, DiLoCo's
    eager updates): from then on it trains as if it had started from the merged version, which
    becomes its update's base.  The local steps taken before the answer came are kept (at most
    :data:`MAX_AHEAD` of the task's: then it waits for the answer); the merge is off the training path.
    A run that screens updates (``Resilience(max_norm_ratio=, min_cosine=, probe_tolerance=)``) trains
    ``"wait"`` instead: the screen judges an update against its base, and the steps taken from a ``W_c``
    it rejected would make a hostile update look harmless.
``"wait"``
    The next task waits for the merge (and, for large models, the commit) of the worker's own update,
    then trains from that version: compute and communication take turns.
``"newest"``
    The next task starts from the newest version the run has when it asks, without its own update
    (which is merged later): nobody waits, and every task's base is a step staler.

Read where ``fit`` is called and kept in the run's spec, so the scheduler and every worker of a run
agree; a run written before the option resumes as it trained (``"wait"``).
``benchmarks/utilization.py`` measured the three (see ``docs/user-guide/how-a-run-works.md``).

This module keeps a worker process's hand-overs that are still out (:class:`Pending`) and applies the
correction (:func:`correct`); :mod:`vcdask.worker` drives them.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ParameterMismatchError
from .params import FlatParams, state_tensors

__all__ = [
    "MAX_AHEAD",
    "OVERLAPS",
    "Base",
    "Pending",
    "check_overlap",
    "correct",
    "forget",
    "most_ahead",
    "put",
    "take",
]

#: What ``vcdask.worker.overlap`` accepts.
OVERLAPS = ("delta", "wait", "newest")
#: A ``"delta"`` task trains at most this share of its steps (and at least one) from its worker's own
#: ``W_c``; then it waits for the merged version, as Streaming DiLoCo overlaps a bounded number of inner
#: steps with its outer sync.  Steps taken from ``W_c`` compute their gradients away from the merged
#: version; while merges keep up this never binds (a merge takes a few of a task's steps), and when they
#: fall behind (a loaded machine, a backed-up queue) it keeps most of each task's steps where they belong.
MAX_AHEAD = 0.5


def most_ahead(steps: int) -> int:
    """How many of a task's ``steps`` it may train before its merged base is there (:data:`MAX_AHEAD`)."""
    return max(1, int(MAX_AHEAD * steps))


def check_overlap(value: Any) -> str:
    """``value`` if it is one of :data:`OVERLAPS`.

    Raises
    ------
    ValueError
        Naming the value and the valid choices.
    """
    if value not in OVERLAPS:
        raise ValueError(f"vcdask.worker.overlap must be one of {list(OVERLAPS)}, got {value!r}")
    return value


@dataclass(frozen=True)
class Base:
    """What a task trains from: the run's answer (``{"version", "step", ...}``) and its parameters;
    ``answer`` None: the run no longer waits for the task (abandon it, nothing trained is written)."""

    answer: dict[str, Any] | None
    params: FlatParams | None = None


@dataclass
class Pending:
    """A shard task's update, handed over to the run and not merged yet, and its ``W_c``.

    Parameters
    ----------
    run_id : str
    answer : concurrent.futures.Future
        The hand-over's answer: it comes once the run has merged the update.
    own : FlatParams
        ``W_c`` as handed over, on the training device (the next task starts from it).
    fraction : float
        The share of its shard's batches the run last gave this worker (``speed_adaptive``).
    """

    run_id: str
    answer: concurrent.futures.Future
    own: FlatParams
    fraction: float = 1.0
    base: concurrent.futures.Future | None = None

    def resolve(self, fetch: Callable[[Pending], Base]) -> None:
        """Fetch the base in a thread: ``fetch(self)`` waits for the answer, and reads its parameters."""
        self.base = _executor().submit(fetch, self)

    def ready(self) -> bool:
        """Whether the base is here (a check between two steps: it never waits)."""
        return self.base is not None and self.base.done()

    def result(self) -> Base:
        """The base, waiting for it if it is not here yet."""
        assert self.base is not None, "resolve() first"
        return self.base.result()


_lock = threading.Lock()
_pending: dict[str, deque[Pending]] = {}
#: Hand-overs kept per run and process: one per worker thread that trained (a thread's next task takes
#: the oldest); more than a worker has threads are never taken.
_MAX_PENDING = 64
_KEEP_RUNS = 4
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def forget(run_id: str) -> int:
    """Drop run ``run_id``'s hand-overs (the run ended: their ``W_c`` may be on a GPU); how many there were."""
    with _lock:
        return len(_pending.pop(run_id, ()))


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            # (a fetch mostly waits for its answer: one thread per worker thread that may be waiting)
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=_MAX_PENDING, thread_name_prefix="vcdask-base")
        return _pool


def put(pending: Pending) -> None:
    """Keep ``pending`` for this process's next task of its run."""
    with _lock:
        queue = _pending.pop(pending.run_id, None) or deque(maxlen=_MAX_PENDING)
        _pending[pending.run_id] = queue  # (the run used last, last)
        queue.append(pending)
        for old in list(_pending)[:-_KEEP_RUNS]:  # a long-lived worker: forget runs long gone
            del _pending[old]


def take(run_id: str) -> Pending | None:
    """The oldest hand-over of ``run_id`` that no task here continues yet (None: there is none)."""
    with _lock:
        queue = _pending.get(run_id)
        return queue.popleft() if queue else None


def _untied(entries: list[tuple[torch.Tensor, Any]]) -> list[tuple[torch.Tensor, Any]]:
    """``entries`` without the second name of a tensor tied to another (``head.weight = emb.weight``: the
    state dict holds it under both names, as views of one storage): a correction made in place once."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    kept = []
    for t, e in entries:
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if t.numel() == 0 or key not in seen:
            seen.add(key)
            kept.append((t, e))
    return kept


def correct(model: torch.nn.Module, merged: FlatParams, own: FlatParams) -> None:
    """``model = merged + (model - own)``, in place, between two steps: the delta rule.

    ``model`` trained on from ``own`` (its ``W_c``); ``merged`` is the server's version holding that
    ``W_c``.  Afterwards the model is ``merged`` plus the local steps taken since ``own``: its update's
    base is ``merged``.  Integer buffers take the same difference (exact); boolean ones take ``merged``'s
    values.  The difference is computed on the model's device (one copy of ``merged`` per dtype).  Where
    ``merged`` is ``own`` bit for bit (the default rule with one task in flight takes each update as it
    is) the model is left as it is: the task goes on exactly as one uninterrupted torch loop.

    Raises
    ------
    ParameterMismatchError
        ``merged`` or ``own`` is not laid out as the model's state.
    """
    layout, tensors = state_tensors(model)
    for other, what in ((merged, "the merged version"), (own, "the task's own W_c")):
        problems = layout.diff(other.layout)
        if problems:
            raise ParameterMismatchError(f"{what} does not fit the model: " + "; ".join(problems))
    with torch.no_grad():
        for dtype, own_flat in own.arrays.items():
            device = own_flat.device
            target = merged.arrays[dtype].to(device, non_blocking=merged.arrays[dtype].is_pinned())
            if torch.equal(target, own_flat):  # the merge took W_c as it was (one task in flight): nothing to
                continue  # correct, and (model - own) + merged would round what the task learned since
            entries = [(t, e) for t, e in zip(tensors, layout.entries, strict=True) if e.dtype == dtype]
            entries = _untied(entries)
            if own_flat.dtype == torch.bool:
                for t, e in entries:
                    t.copy_(target[e.offset : e.offset + e.size].view(t.shape))
                continue
            # (model - own) + merged, in that order: what the task learned, added to the merged version, so
            # a task that learned nothing yet (or with a learning rate of 0) holds the merged version exactly
            mine = [own_flat[e.offset : e.offset + e.size].view(t.shape) for t, e in entries]
            theirs = [target[e.offset : e.offset + e.size].view(t.shape) for t, e in entries]
            tensors_here = [t for t, _ in entries]
            if own_flat.is_floating_point():
                torch._foreach_sub_(tensors_here, mine)
                torch._foreach_add_(tensors_here, theirs)
            else:
                for t, m, o in zip(tensors_here, mine, theirs, strict=True):
                    t.sub_(m).add_(o)
