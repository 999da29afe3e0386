"""Training and evaluation steps: the default ``loss(model(x), y)`` and the caller's own.

``fit(..., train_step=fn)`` takes ``fn(model, batch) -> loss tensor`` for models that are not
``model(X) -> output`` (several inputs, dict batches, a language model's shifted targets...), and
``eval_step=fn`` takes ``fn(model, batch) -> {"name": value}``: each value is averaged over the
validation set, weighted by batch size, and becomes a column of ``FitResult.epochs``.  Without an
``eval_step``, a run with a ``train_step`` reports the validation ``loss`` (the train step's loss,
without gradients); the default step reports the loss and the ``metrics`` of the outputs.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._ints import is_real
from ._step_checks import (
    check_backward,
    check_layout_kept,
    check_loss,
    finite,
    is_loss,
    refuse_non_finite,
    state_layout,
)
from .device import cpu_copy, to
from .errors import DataError
from .metrics import check_metric_names

if TYPE_CHECKING:
    from .prepared import PreparedData

__all__ = ["SupervisedStep", "check_steps", "eval_modules", "evaluate", "probe_batch", "train_mode"]


def _xy(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"the default step needs (x, y) batches, got a {type(batch).__name__}; pass train_step=fn(model, batch) "
        "(and eval_step=) for other batches"
    )


class SupervisedStep:
    """The default training step: ``loss(model(x), y)`` on an ``(x, y)`` batch."""

    def __init__(self, loss: Callable):
        self.loss = loss

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = _xy(batch)
        return self.loss(model(x), y)


def eval_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """The submodules, by name, that ``model`` trains with in eval mode: those the user froze, the topmost only.

    Frozen: in eval mode with every submodule of its own, and every parameter frozen (``requires_grad``
    False): a batch norm whose running statistics fine-tuning keeps, a frozen feature extractor.  A layer of
    buffers alone (a batch norm without ``affine``) has no parameter to freeze: it is kept in eval mode when
    put there under a parent in train mode.  Otherwise the root's mode does not count: a trainable backbone in
    eval mode (a pretrained model's loader puts it there), a parameterless dropout, and every layer of a model
    wholly in eval mode (``vcdask.load``'s) train in train mode, as ``model.train()`` sets them.

    Examples
    --------
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout())
    >>> _ = model.eval(), model[1].requires_grad_(False)
    >>> eval_modules(model)
    ('1',)
    """
    kept: list[str] = []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not name or any(name.startswith(f"{above}.") for above in kept):
            continue
        if not all(not m.training for m in module.modules()):
            continue
        params = list(module.parameters())
        if params:
            frozen = all(not p.requires_grad for p in params)
        else:  # (a layer of buffers alone, a batch norm without affine: put in eval mode under a parent in train mode)
            parent = modules[name.rpartition(".")[0]]
            frozen = parent.training and next(module.buffers(), None) is not None
        if frozen:
            kept.append(name)
    return tuple(kept)


def train_mode(model: torch.nn.Module, frozen: tuple[str, ...] = ()) -> torch.nn.Module:
    """``model`` in train mode but for the submodules named in ``frozen`` (:func:`eval_modules` of the model
    given to ``fit``: the run's ``RunSpec.eval_modules``), each of which is put in eval mode with all its own."""
    model.train()
    for name in frozen:
        model.get_submodule(name).eval()
    return model


def _value(v: Any, name: str) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"eval_step's {name!r} must be a number or a 0-d tensor, got shape {tuple(v.shape)}")
        return float(v.detach())
    if is_real(v):
        return float(v)
    raise TypeError(f"eval_step's {name!r} must be a number or a 0-d tensor, got {type(v).__name__}")


def evaluate(spec, model: torch.nn.Module, batches: Iterable[tuple[Any, int]], precision) -> dict[str, float]:
    """Validation numbers of ``model`` over ``(batch, n)`` pairs, without gradients.

    The default step concatenates the outputs and computes ``loss`` and each metric over all of them;
    an ``eval_step`` (or a ``train_step`` alone) is averaged over batches, weighted by their size.
    """
    model.eval()
    if spec.train_step is None:
        # the forward passes under the run's precision; the loss and the metrics in float32 on the CPU, whatever the
        # worker's device (under a CPU worker's autocast, a metric with a matmul was computed in bf16 / fp16: the
        # same version validated other numbers there than on a GPU worker, whose autocast leaves the CPU alone)
        with torch.no_grad():
            outs, ys = [], []
            for batch, _ in batches:
                x, y = _xy(batch)
                with precision.autocast():
                    out = model(x)
                outs.append(out.float().cpu())
                ys.append(y.cpu())
            out, y = torch.cat(outs), torch.cat(ys)
            result = {"loss": float(spec.loss(out, y))}
            result.update({name: float(fn(out, y)) for name, fn in spec.metrics.items()})
            return result
    with torch.no_grad(), precision.autocast():  # (a custom step: the forward and its loss, as in training)
        sums: dict[str, float] = {}
        total = 0
        for batch, n in batches:
            if spec.eval_step is None:
                values: Mapping[str, Any] = {"loss": spec.train_step(model, batch)}
            else:
                values = spec.eval_step(model, batch)
                if not isinstance(values, Mapping):
                    raise TypeError(f"eval_step must return a dict of metric values, got {type(values).__name__}")
            for name, v in values.items():
                sums[str(name)] = sums.get(str(name), 0.0) + _value(v, name) * n
            total += n
        return {name: s / total for name, s in sums.items()} if total else {}


def check_steps(
    model: torch.nn.Module,
    sample: Any,
    train_step: Callable,
    eval_step: Callable | None,
    data: tuple[PreparedData, torch.dtype] | None = None,
) -> list[str]:
    """Run the steps once on a probe batch (on the CPU, as a copy of the model there); return the metric names.

    A model on an accelerator whose steps fail on the CPU copy is tried once more on a copy on its own device
    (steps written for it, that move the batch there with ``.cuda()``).  Gradients the train step's loss leaves on
    ``model`` itself (a step over the model captured from outside, refused) are cleared again.  A train step's loss
    that is NaN or infinite on the probe batch (its first rows: a masked loss over no labelled row) is tried again
    on up to :data:`MORE_ROWS` rows spread over ``data`` (the ``PreparedData`` and the inputs' dtype ``sample``
    came from, :func:`probe_batch`), and refused only when it is non-finite on all of them; where those rows
    cannot be read cheaply (dask arrays), or without ``data``, not at all.

    Raises
    ------
    DataError
        A step fails on the probe batch; the train step returns something that is not a scalar loss, or a loss that
        is NaN or infinite on the probe batch and on more rows of the data, does not backpropagate or gives none of
        the probe's trainable parameters a gradient (a model captured from outside), or the step computed gradients
        itself (``loss.backward()``); the train step adds, removes or reshapes a parameter or buffer of the model
        (:mod:`vcdask._step_checks`).  Trainable parameters without a gradient while others get one are not
        looked at (they cannot be told from an unrouted expert, a dropped layer, a head for ``eval_step``).
    TypeError
        ``eval_step`` returns something other than a dict of numbers.
    ValueError
        ``eval_step``'s names would replace columns of ``FitResult.epochs`` (:func:`vcdask.metrics.check_metric_names`).
    """
    frozen = eval_modules(model)  # (trained as the workers will train it)
    clear = [p for p in model.parameters() if p.grad is None]
    try:
        try:
            names = _check_steps_on(train_mode(cpu_copy(model), frozen), sample, train_step, eval_step, data)
        except DataError:
            if all(t.device.type == "cpu" for t in itertools.chain(model.parameters(), model.buffers())):
                raise
            names = _check_steps_on(train_mode(copy.deepcopy(model), frozen), sample, train_step, eval_step, data)
    finally:
        for p in clear:  # (a step over the model captured from outside backpropagated into it)
            p.grad = None
    return check_metric_names(names, "eval_step", loss=True)


def _check_steps_on(
    probe: torch.nn.Module,
    sample: Any,
    train_step: Callable,
    eval_step: Callable | None,
    data: tuple[PreparedData, torch.dtype] | None,
) -> list[str]:
    """The metric names of the steps on ``probe`` (a copy of the model)."""
    for p in probe.parameters():
        p.grad = None
    layout = state_layout(probe)
    try:
        loss = train_step(probe, sample)
    except Exception as e:
        raise DataError(f"train_step fails on a batch of the training data: {type(e).__name__}: {e}") from e
    check_layout_kept(layout, probe)
    check_loss(loss, probe)
    if not finite(loss):
        loss = _loss_on_more_rows(probe, data, train_step, layout, loss)
    check_backward(probe, loss)
    if eval_step is None:
        return ["loss"]
    probe.eval()
    try:
        with torch.no_grad():
            values = eval_step(probe, sample)
    except Exception as e:
        raise DataError(f"eval_step fails on a batch of the data: {type(e).__name__}: {e}") from e
    if not isinstance(values, Mapping) or not values:
        raise TypeError(f"eval_step must return a non-empty dict of metric values, got {values!r}")
    names = []
    for name, v in values.items():
        f = _value(v, name)
        if not isinstance(name, str):
            raise TypeError(f"eval_step's metric names must be strings, got {name!r}")
        if math.isinf(f):
            raise DataError(f"eval_step's {name!r} is infinite on a probe batch")
        names.append(name)
    return names


def check_default_loss(model: torch.nn.Module, data: tuple[PreparedData, torch.dtype], loss: Callable) -> None:
    """The default step's ``loss``, non-finite on the probe rows in eval mode (:func:`vcdask._forward_check.
    check_model`): tried again, in train mode as the workers train, on the probe rows and on more rows spread
    over the data (:func:`_loss_on_more_rows`); refused only where it is non-finite on all of them (a loss over some
    rows only is NaN on first rows that hold none; a BatchNorm spoiled for eval mode trains).

    Raises
    ------
    DataError
        The loss is non-finite on every batch tried.
    """
    step = SupervisedStep(loss)
    probe = train_mode(cpu_copy(model), eval_modules(model))
    prepared, x_dtype = data
    first = step(probe, probe_batch(prepared, x_dtype))  # (with gradients: a loss, as _loss_on_more_rows takes it)
    if not finite(first):
        _loss_on_more_rows(probe, data, step, state_layout(probe), first, "the loss of the model's outputs")


def _loss_on_more_rows(
    probe: torch.nn.Module,
    data: tuple[PreparedData, torch.dtype] | None,
    train_step: Callable,
    layout: dict,
    loss: Any,
    what: str = "train_step's loss",
) -> torch.Tensor:
    """The train step's loss on more rows of the training data, a few batches spread over it, where ``loss`` (on
    the probe batch) is not finite: the first finite one; ``loss`` itself where those rows cannot be read
    here or the step does not give a loss on them (the run reports its own failures).

    Raises
    ------
    DataError
        The loss is non-finite on all of them too (:func:`vcdask._step_checks.refuse_non_finite`).
    """
    reads = None if data is None else _more_batches(*data)
    if reads is None:  # (not refused on the first rows alone: the run's pause names the training when all are NaN)
        return loss
    values, rows = [float(loss.detach().float())], 0
    for read in reads:
        try:
            batch, n = read()
            other = train_step(probe, batch)
        except Exception:  # noqa: BLE001 - unread rows, or a step failing on them: no evidence either way
            return loss
        check_layout_kept(layout, probe)
        if not is_loss(other):
            return loss
        if finite(other):
            return other
        values.append(float(other.detach().float()))
        rows += n
    refuse_non_finite(values, rows, what)


#: At most this many rows of the training data, read in :data:`MORE_BATCHES` batches spread over it, are tried
#: when the train step's loss is non-finite on the probe batch (its first rows).
MORE_ROWS = 256
MORE_BATCHES = 4


def probe_batch(prepared: PreparedData, x_dtype: torch.dtype) -> Any:
    """A few rows of the data as the batch a custom step will get (on CPU); :func:`check_steps`, given
    ``(prepared, x_dtype)``, reads more rows as it does when the train step's loss is non-finite on them."""
    rows = prepared.sample if prepared.form in ("dataset", "dict") else (prepared.sample_X, prepared.sample_y)
    return _batch(prepared, x_dtype, rows)


def _batch(prepared: PreparedData, x_dtype: torch.dtype, rows: Any) -> Any:
    """``rows`` of ``prepared`` (a Dataset's collated batch, a dict of arrays, or ``(X, y)``) as a batch on CPU."""
    if prepared.form == "dataset":
        return to(rows, torch.device("cpu"), x_dtype)

    def tensor(a) -> torch.Tensor:
        t = torch.as_tensor(np.ascontiguousarray(a))
        return t.to(x_dtype) if t.is_floating_point() else t

    if prepared.form == "dict":
        return {k: tensor(a) for k, a in rows.items()}
    X, y = rows
    y = tensor(y)
    return tensor(X), y.long() if prepared.classification else y


def _more_batches(prepared: PreparedData, x_dtype: torch.dtype) -> list[Callable[[], tuple[Any, int]]] | None:
    """Readers of up to :data:`MORE_ROWS` rows of ``prepared``, in :data:`MORE_BATCHES` batches spread over it,
    read as :func:`probe_batch` reads it: each gives a batch and its number of rows.  None where its rows cannot be
    read cheaply here (:func:`_row_reader`)."""
    read = _row_reader(prepared)
    if read is None:
        return None
    n = prepared.n
    size = max(min(2, n), min(MORE_ROWS // MORE_BATCHES, n // MORE_BATCHES))
    starts = sorted({round(i * (n - size) / (MORE_BATCHES - 1)) for i in range(MORE_BATCHES)})
    return [functools.partial(_read_batch, prepared, x_dtype, read, a, a + size) for a in starts]


def _read_batch(prepared: PreparedData, x_dtype: torch.dtype, read: Callable, start: int, stop: int) -> tuple[Any, int]:
    return _batch(prepared, x_dtype, read(start, stop)), stop - start


def _row_reader(prepared: PreparedData) -> Callable[[int, int], Any] | None:
    """How to read rows ``[start, stop)`` of ``prepared``'s data, as :func:`_batch` takes them: a Dataset's items,
    collated; a Zarr store's rows, where it lives; in-memory arrays' rows.  None for dask arrays: computing them
    is work for the cluster, not for the pre-flight."""
    source, form = prepared.source, prepared.form
    if form == "dataset":
        return None if source is None else lambda a, b: source.batch(range(a, b))
    if source is not None:
        opened: dict[str, Any] = {}

        def read(a: int, b: int) -> Any:
            if "ds" not in opened:  # (opened once, on the first read)
                opened["ds"] = source.open()
            ds = opened["ds"]
            return source.read_columns(a, b, ds) if form == "dict" else source.read(a, b, ds)

        return read
    arrays = dict(prepared.columns or {}) if form == "dict" else {"X": prepared.X, "y": prepared.y}
    if not arrays or not all(isinstance(a, np.ndarray) for a in arrays.values()):
        return None
    if form == "dict":
        return lambda a, b: {k: v[a:b] for k, v in arrays.items()}
    return lambda a, b: (arrays["X"][a:b], arrays["y"][a:b])
