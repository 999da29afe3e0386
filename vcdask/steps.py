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
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._ints import is_real
from ._step_checks import check_backward, check_layout_kept, check_loss, state_layout, warn_no_gradient
from .device import cpu_copy
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


def check_steps(model: torch.nn.Module, sample: Any, train_step: Callable, eval_step: Callable | None) -> list[str]:
    """Run the steps once on a probe batch (on the CPU, as a copy of the model there); return the metric names.

    A model on an accelerator whose steps fail on the CPU copy is tried once more on a copy on its own device
    (steps written for it, that move the batch there with ``.cuda()``).  Gradients the train step's loss leaves on
    ``model`` itself (a step over the model captured from outside, refused) are cleared again.

    Raises
    ------
    DataError
        A step fails on the probe batch; the train step returns something that is not a scalar loss, or a loss that
        is NaN or infinite, does not backpropagate or gives none of the probe's trainable parameters a gradient (a
        model captured from outside), or the step computed gradients itself (``loss.backward()``); the train step
        adds, removes or reshapes a parameter or buffer of the model (:mod:`vcdask._step_checks`).
    TypeError
        ``eval_step`` returns something other than a dict of numbers.
    ValueError
        ``eval_step``'s names would replace columns of ``FitResult.epochs`` (:func:`vcdask.metrics.check_metric_names`).

    Warns
    -----
    UserWarning
        Some trainable parameters got no gradient from the train step's loss while others did (a submodule
        captured from outside, ``head = model[2]``), naming them.
    """
    frozen = eval_modules(model)  # (trained as the workers will train it)
    clear = [p for p in model.parameters() if p.grad is None]
    try:
        try:
            names, missing = _check_steps_on(train_mode(cpu_copy(model), frozen), sample, train_step, eval_step)
        except DataError:
            if all(t.device.type == "cpu" for t in itertools.chain(model.parameters(), model.buffers())):
                raise
            names, missing = _check_steps_on(train_mode(copy.deepcopy(model), frozen), sample, train_step, eval_step)
    finally:
        for p in clear:  # (a step over the model captured from outside backpropagated into it)
            p.grad = None
    warn_no_gradient(missing)
    return check_metric_names(names, "eval_step", loss=True)


def _check_steps_on(
    probe: torch.nn.Module, sample: Any, train_step: Callable, eval_step: Callable | None
) -> tuple[list[str], list[str]]:
    """The metric names, and the trainable parameters the train step's loss gave no gradient, of the steps on
    ``probe`` (a copy of the model)."""
    for p in probe.parameters():
        p.grad = None
    layout = state_layout(probe)
    try:
        loss = train_step(probe, sample)
    except Exception as e:
        raise DataError(f"train_step fails on a batch of the training data: {type(e).__name__}: {e}") from e
    check_layout_kept(layout, probe)
    check_loss(loss, probe)
    missing = check_backward(probe, loss)
    if eval_step is None:
        return ["loss"], missing
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
    return names, missing


def probe_batch(prepared: PreparedData, x_dtype: torch.dtype) -> Any:
    """A few rows of the data as the batch a custom step will get (on CPU)."""
    if prepared.form == "dataset":
        from .device import to

        return to(prepared.sample, torch.device("cpu"), x_dtype)

    def tensor(a) -> torch.Tensor:
        t = torch.as_tensor(np.ascontiguousarray(a))
        return t.to(x_dtype) if t.is_floating_point() else t

    if prepared.form == "dict":
        return {k: tensor(a) for k, a in prepared.sample.items()}
    y = tensor(prepared.sample_y)
    return tensor(prepared.sample_X), y.long() if prepared.classification else y
