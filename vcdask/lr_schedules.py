"""Learning-rate schedules over the whole run, indexed by its global count of local steps.

A shard task trains a few local steps from the version it was given, while other tasks train
theirs.  A schedule written per task (``lr_schedule=fn(epoch, step)``, ``step`` within the task)
starts again with every task: a warm-up is repeated by every shard, and a decay can only step
once per epoch.  The schedules here are indexed instead by the **global count of local steps**
(as Liu et al.'s asynchronous Local-SGD does): the steps of every shard handed out before this
task, in the order the run handed them out, plus this task's own.  A run's ``total`` is the
steps of all its epochs (``max_epochs`` passes over every shard, ``local_epochs`` each), so a
cosine decay reaches its end as the run's last shard ends, whatever the number of workers, as it
does in single-process torch over the same data::

    vcdask.fit(model, data, lr_schedule=vcdask.lr_schedules.Cosine(warmup=0.05))

A re-issued copy of a shard trains with the learning rates of the copy it replaces.  A shard
task trained from ``speed_adaptive``'s share of its batches keeps its place on the same scale.

:class:`OverRun` wraps any ``fn(step, total) -> factor``; the factor scales the optimizer's own
learning rate(s), as ``torch.optim.lr_scheduler.LambdaLR`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ._ints import is_real

__all__ = ["Constant", "Cosine", "Linear", "OverRun", "RunSchedule", "run_steps"]


class RunSchedule:
    """A learning-rate factor over the whole run: ``schedule(step, total) -> factor``.

    ``step`` counts the run's local steps before this one (0-based, across every shard task in the
    order the run handed them out); ``total`` is the run's local steps in all.  Subclasses define
    :meth:`factor`.
    """

    def factor(self, step: int, total: int) -> float:
        raise NotImplementedError

    def __call__(self, step: int, total: int) -> float:
        return self.factor(step, max(int(total), 1))


def _check_fraction(name: str, value: float, high: float = 1.0) -> float:
    if not is_real(value) or not 0.0 <= float(value) < high:
        bound = "1)" if high == 1.0 else f"{high:g}]"
        raise ValueError(f"{name} must be a number in [0, {bound}, got {value!r}")
    return float(value)


def _warm(step: int, total: int, warmup: float) -> float | None:
    """The warm-up factor at ``step`` (linear from ``1/n`` to 1 over the first ``warmup`` of the
    run), or None past it."""
    n = math.ceil(warmup * total)
    return (step + 1) / n if step < n else None


@dataclass(frozen=True)
class Constant(RunSchedule):
    """The optimizer's learning rate throughout, after an optional linear warm-up.

    Parameters
    ----------
    warmup : float, default 0
        The fraction of the run's local steps over which the rate rises linearly to its full value.
    """

    warmup: float = 0.0

    def __post_init__(self) -> None:
        _check_fraction("warmup", self.warmup)

    def factor(self, step: int, total: int) -> float:
        warm = _warm(step, total, self.warmup)
        return 1.0 if warm is None else warm


@dataclass(frozen=True)
class _Decay(RunSchedule):
    """A linear warm-up over ``warmup`` of the run, then a decay from 1 to ``final`` (:meth:`shape`).

    ``final`` is the factor *after* the run's last local step (at ``step == total``), as
    ``torch.optim.lr_scheduler.CosineAnnealingLR`` and Hugging Face's schedules reach their end: the
    last step (``step == total - 1``) trains one step short of it (``Linear()(7, 8) == 0.125``).
    """

    warmup: float = 0.0
    final: float = 0.0

    def __post_init__(self) -> None:
        _check_fraction("warmup", self.warmup)
        _check_fraction("final", self.final, high=1.0 + 1e-12)

    def shape(self, progress: float) -> float:
        """The decay from 1 (``progress`` 0) to 0 (``progress`` 1)."""
        raise NotImplementedError

    def factor(self, step: int, total: int) -> float:
        warm = _warm(step, total, self.warmup)
        if warm is not None:
            return warm
        n = math.ceil(self.warmup * total)
        progress = min(1.0, (step - n) / max(1, total - n))
        return self.final + (1.0 - self.final) * self.shape(progress)


@dataclass(frozen=True)
class Cosine(_Decay):
    """Cosine decay from the optimizer's learning rate to ``final`` times it, after a linear warm-up.

    Parameters
    ----------
    warmup : float, default 0
        The fraction of the run's local steps spent warming up.
    final : float, default 0
        The factor the rate decays to, reached after the run's last local step (at ``step == total``;
        the last step itself, ``total - 1``, trains one step short of it, as in torch's
        ``CosineAnnealingLR``).
    """

    def shape(self, progress: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Linear(_Decay):
    """Linear decay from the optimizer's learning rate to ``final`` times it, after a linear warm-up.

    Parameters
    ----------
    warmup : float, default 0
        The fraction of the run's local steps spent warming up.
    final : float, default 0
        The factor the rate decays to, reached after the run's last local step (at ``step == total``;
        the last step itself, ``total - 1``, trains at ``final + (1 - final) / (total - n)``, ``n`` the
        warm-up's steps, as in torch's ``LinearLR``).
    """

    def shape(self, progress: float) -> float:
        return 1.0 - progress


@dataclass(frozen=True)
class OverRun(RunSchedule):
    """Any ``fn(step, total) -> factor`` over the run's global count of local steps.

    Parameters
    ----------
    fn : callable
        ``fn(step, total)``: ``step`` the local steps of the run before this one, ``total`` the
        run's local steps in all.  It must be picklable (a module-level function, or a lambda
        when cloudpickle is installed, as it is with Dask).
    """

    fn: Callable[[int, int], float]

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"OverRun needs a callable fn(step, total) -> factor, got {type(self.fn).__name__}")

    def factor(self, step: int, total: int) -> float:
        return self.fn(step, total)


def run_steps(spec) -> tuple[float, int]:
    """``(per_shard, total)``: a shard's local steps on average, and the run's in all.

    ``per_shard`` places a shard task on the run's global scale (its position in the run's order
    times ``per_shard``); ``total`` is ``max_epochs`` passes of ``local_epochs`` over every shard."""
    shards = spec.shards
    per_epoch = 0
    for shard in range(shards.n_shards):
        start, stop = shards.bounds(shard)
        per_epoch += spec.local_epochs * -(-(stop - start) // spec.batch_size)
    return per_epoch / shards.n_shards, per_epoch * spec.max_epochs
