"""The server's probe: a private CPU copy of the model and a few fixed rows, to score parameters in the merge thread.

Robust merging (:mod:`vcdask.engine.guard`) scores an update on the first rows of the validation set and
takes the server's own steps on the first rows of its shard; the ``"probe"`` merge rule
(:class:`vcdask.merge.Probe`) scores candidate server parameters by their training loss on a fixed
sample of the training set: the first rows of every shard, :data:`PROBE_ROWS` in all, so that shards
that differ (data sorted by label) are all represented.  Everything here runs in the merge thread.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import torch

from .._seeds import derived_seeds, task_rng
from .following import can_grow

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..params import FlatParams
    from ..spec import RunSpec

__all__ = ["PROBE_ROWS", "ProbeModel", "training_probe"]

#: Rows each probe scores: the first ones of the validation set (robust merging), of the update's shard
#: (the guard's own steps), or spread over the first rows of every shard (the training-loss probe).
PROBE_ROWS = 256

#: Set apart the probe's seeds from the tasks' (``(seed, epoch, shard, attempt)``, epochs from 1).
_PROBE = 0


class ProbeModel:
    """A private CPU copy of ``spec``'s model in float32, with the rows it scores parameters on.

    Parameters
    ----------
    spec : RunSpec
        The run's model, loss or steps, optimizer, shards, training and validation data.
    rows : int
        Rows each probe reads (:data:`PROBE_ROWS`).
    """

    def __init__(self, spec: RunSpec, rows: int = PROBE_ROWS):
        from ..device import Precision
        from ..steps import SupervisedStep

        self.spec = spec
        self.rows = int(rows)
        self.device = torch.device("cpu")
        self.precision = Precision("32", self.device)
        self._model: torch.nn.Module | None = None  # (copied at the first probe, in the merge thread)
        self.step = spec.train_step or SupervisedStep(spec.loss)
        self.calls = 0  # losses computed (each one forward pass over the probe's rows)
        self._validation: list | None = None  # the probes' batches, cut once
        self._train: dict[int, list] = {}  # by the rows asked for

    @property
    def model(self) -> torch.nn.Module:
        """The private copy of the run's model, made at its first use (in the merge thread, not when the run
        starts on the scheduler's event loop)."""
        if self._model is None:
            self._model = copy.deepcopy(self.spec.model).to(self.device)
        return self._model

    def _batches(self, rows, batch_size: int, generator: torch.Generator | None = None):
        from .. import batches as _batches

        return _batches.batches(self.spec, rows, self.device, batch_size, generator=generator)

    def _score(self, params: FlatParams, batches: list) -> float:
        from ..params import load_into
        from ..steps import evaluate

        load_into(self.model, params)
        self.calls += 1
        return float(evaluate(self.spec, self.model, batches, self.precision)["loss"])

    def _fixed(self, chunks: list) -> list:
        """The batches over ``chunks`` (rows), cut once: a probe scores the same rows every time, so a
        dataset's items are read once, and arrays' rows from all shards go as one batch, not one a shard."""
        from .. import batches as _batches

        if chunks and all(isinstance(c, dict) for c in chunks):
            chunks = [{k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}]
        size = max(self.spec.batch_size, 512)
        return [b for rows in chunks for b in _batches.batches(self.spec, rows, self.device, size)]

    def loss(self, params: FlatParams) -> float:
        """The loss of ``params`` on the first :attr:`rows` rows of the validation set."""
        from .. import batches as _batches

        if self._validation is None:
            n = min(self.spec.validation.n, self.rows)
            self._validation = self._fixed([_batches.rows(self.spec, self.spec.validation, 0, n)])
        return self._score(params, self._validation)

    def train_loss(self, params: FlatParams, rows: int | None = None) -> float:
        """The loss of ``params`` on a fixed sample of the training set: the first ``rows / n_shards`` rows
        (rounded up) of every shard, or with fewer rows than shards the first row of ``rows`` shards spread
        evenly over them; ``rows`` defaults to :attr:`rows` (a merge rule that chose fewer, to make its
        probe cheaper, passes its own)."""
        from .. import batches as _batches

        rows = self.rows if rows is None else int(rows)
        cut = self._train.get(rows)
        if cut is None:
            shards = self.spec.shards
            n = shards.n_shards
            if rows < n:  # fewer rows than shards: the first row of ``rows`` shards spread over them all
                picked, each = sorted({i * n // rows for i in range(rows)}), 1
            else:
                picked, each = list(range(n)), math.ceil(rows / n)
            chunks = []
            for shard in picked:
                start, stop = shards.bounds(shard)
                if stop > start:
                    chunks.append(_batches.rows(self.spec, self.spec.train, start, min(stop, start + each)))
            cut = self._train[rows] = self._fixed(chunks)
        return self._score(params, cut)

    def own_step(self, base: FlatParams, shard: int, steps: int) -> FlatParams:
        """The parameters after ``steps`` steps of the run's optimizer from ``base`` on the first :attr:`rows`
        rows of ``shard`` (cycled, in a seeded order)."""
        from .. import batches as _batches
        from ..params import flatten, load_into
        from ..steps import train_mode

        start, stop = self.spec.shards.bounds(shard)
        rows = _batches.rows(self.spec, self.spec.train, start, min(stop, start + self.rows))
        load_into(self.model, base)
        train_mode(self.model, getattr(self.spec, "eval_modules", ()))  # as the workers train it
        optimizer = self.spec.optimizer(list(self.model.parameters()))  # (a list, as the workers give it)
        # (its own seeds: the process's global generator, which the caller of fit may own, is left as it was)
        order_seed, torch_seed = derived_seeds(self.spec.seed, _PROBE, shard)
        g = torch.Generator().manual_seed(order_seed)
        done = 0
        with task_rng(torch_seed):
            while done < steps:
                for batch, _ in self._batches(rows, self.spec.batch_size, g):
                    loss = self.step(self.model, batch)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    done += 1
                    if done == steps:
                        break
        return flatten(self.model)


def training_probe(spec: RunSpec) -> Callable[[FlatParams], float] | None:
    """The training-loss probe for ``spec``'s merge rule, if it needs one (:attr:`MergeRule.needs`), or
    may come to: ``fit``'s default for a run that starts with few tasks in flight becomes ``"auto"`` as
    its fleet grows (:mod:`vcdask.engine.following`).  Nothing is copied before its first probe."""
    rule = spec.merge
    if "loss" in rule.needs:
        return ProbeModel(spec, rows=int(getattr(rule, "rows", PROBE_ROWS))).train_loss
    if spec.merge_in_flight is None or not can_grow(rule):
        return None
    from ..merge import Auto

    return ProbeModel(spec, rows=Auto().rows).train_loss
