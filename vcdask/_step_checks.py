"""What the pre-flight checks of a ``train_step`` look at on its probe copy of the model, beside running it
(:func:`vcdask.steps.check_steps`): what the step returns, that its loss is finite (on the probe batch, or else
on more rows of the data: ``check_steps`` reads them) and backpropagates into the model it was given, and that it
leaves the model's ``state_dict()`` layout as it found it.

Each is a mistake that passed the pre-flight and then trained wrong or failed on the cluster: a step over a model
captured from outside trained nothing and the run "succeeded"; a NaN loss failed the run minutes later, blaming
the worker; a step that added a submodule had every update rejected as a layout mismatch.

What they do not look at: trainable parameters that get no gradient while others do.  From one batch that cannot
tell a submodule captured from outside (``head = model[2]``) from a legitimate model: the experts a batch does not
route to, layers dropped at random, a head only ``eval_step`` uses, a teacher run under ``torch.no_grad()``; a
warning for them came and went between fits and broke test suites run with ``-W error``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NoReturn

import torch

from .errors import DataError

__all__ = [
    "check_backward",
    "check_layout_kept",
    "check_loss",
    "finite",
    "is_loss",
    "refuse_non_finite",
    "state_layout",
]

#: What vcdask does after the step, for the messages of a step that does some of it itself.
_REST = (
    "train_step(model, batch) returns the loss and vcdask does the rest of the step: zero the gradients, "
    "backward (under the run's precision), clip (clip_grad_norm=) and the optimizer step"
)


def state_layout(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
    """``model.state_dict()``'s entries as ``name -> (shape, dtype)`` (None for an entry that is not a tensor:
    a module's extra state), the layout that every update of the run must keep."""
    return {
        name: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None
        for name, t in model.state_dict().items()
    }


def check_layout_kept(before: Mapping[str, Any], model: torch.nn.Module) -> None:
    """Refuse a step that changed ``model``'s :func:`state_layout` from ``before`` (added, removed or reshaped a
    parameter or buffer: ``model.extra = nn.Linear(...)`` on a first call).

    Raises
    ------
    DataError
        Naming the entries added, removed and changed, and the remedy: make them in the model before ``fit``.
    """
    after = state_layout(model)
    added = [n for n in after if n not in before]
    removed = [n for n in before if n not in after]
    changed = [
        f"{n} {_shape(was)} -> {_shape(after[n])}" for n, was in before.items() if n in after and after[n] != was
    ]
    if not (added or removed or changed):
        return
    entries = (("added", added), ("removed", removed), ("changed", changed))
    parts = [f"{what} {_few(names)}" for what, names in entries if names]
    raise DataError(
        f"train_step changes the model's parameters or buffers ({'; '.join(parts)}): every update the workers "
        "send must keep the layout of the model given to fit (its state_dict()), so each would be rejected. "
        "Create every submodule, parameter and buffer in the model before fit (in its __init__, or with one "
        "call on a batch beforehand, as a lazily built model needs); train_step only computes the loss"
    )


def check_loss(loss: Any, model: torch.nn.Module) -> None:
    """Refuse what a train step returned on ``model`` (its probe copy) unless it is a scalar loss tensor with a
    gradient (its value is not looked at here: :func:`finite`); a step that computed gradients itself
    (``loss.backward()``: on the workers every step failed, 'Trying to backward through the graph a second time')
    is said to be one first, whatever it returned (``loss.detach()`` or ``loss.item()`` after its backward).

    Raises
    ------
    DataError
        Saying what it returned and what to return instead.
    """
    if any(p.grad is not None for p in model.parameters()):  # (before the checks below: the cause of a detached loss)
        raise DataError(f"train_step computes gradients itself (loss.backward() in the step): {_REST}; return the loss")
    if is_loss(loss):
        return
    if isinstance(loss, torch.Tensor):
        what = f"a tensor of shape {tuple(loss.shape)}"
        hint = "" if loss.numel() == 1 else "; reduce it to one number for the batch (its .mean() or .sum())"
        if not loss.requires_grad:
            hint += "; return it as computed from the model's outputs (not loss.detach(), nor under torch.no_grad())"
    elif isinstance(loss, Mapping):
        key = "loss" if "loss" in loss else next(iter(loss), "loss")
        what, hint = (
            f"a {type(loss).__name__} with keys {list(loss)[:6]}",
            f"; return the loss tensor itself (out[{key!r}])",
        )
    elif isinstance(loss, (tuple, list)):
        what, hint = (
            f"a {type(loss).__name__} of {len(loss)}",
            f"; return the loss tensor alone, not a {type(loss).__name__}",
        )
    else:
        what, hint = type(loss).__name__, "; return the loss tensor itself (not loss.item() or float(loss))"
    grad = " that requires grad" if isinstance(loss, torch.Tensor) and not loss.requires_grad else ""
    raise DataError(f"train_step must return a scalar loss tensor{grad}, got {what}{hint}")


def is_loss(loss: Any) -> bool:
    """Whether a train step's ``loss`` is what it must return: a scalar tensor with a gradient."""
    return isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad


def finite(loss: torch.Tensor) -> bool:
    """Whether the value of ``loss`` (a scalar tensor) is finite."""
    return math.isfinite(float(loss.detach().float()))


def refuse_non_finite(values: list[float], rows: int, what: str = "train_step's loss") -> NoReturn:
    """Refuse a train step whose loss (``what``) is non-finite (``values``) on the probe batch and on ``rows`` more
    rows of the training data spread over it, a few batches of them: every update of such a run is non-finite, and the
    run fails on the cluster minutes later, blaming its workers.  (On the probe batch alone it is not refused: a
    masked loss, a mean over the labelled rows only, is NaN on first rows that hold none.)

    Raises
    ------
    DataError
        Naming the values, where they were computed and what to look at.
    """
    raise DataError(
        f"{what} is {values[0]} on a probe batch of the training data (its first rows), and non-finite "
        f"on {rows} more rows across it too ({_few([str(v) for v in values[1:]])}): a non-finite loss gives "
        "non-finite updates, which the run rejects until it fails; look for a log or a division of 0 in the loss "
        "(torch.log(p + eps), a mean over no elements) or for non-finite parameters in the model"
    )


def check_backward(model: torch.nn.Module, loss: torch.Tensor) -> None:
    """Backpropagate the train step's ``loss`` as the task's step will, into ``model`` (its probe copy).

    Some trainable parameters without a gradient, while others get one, are left alone (see the module's
    docstring: from one batch they cannot be told from a legitimate model's).

    Raises
    ------
    DataError
        The loss cannot be backpropagated, or no trainable parameter of ``model`` got a gradient: the loss does
        not depend on the model given to the step (a model captured from outside instead).
    """
    try:
        loss.backward()
    except Exception as e:
        raise DataError(f"train_step's loss cannot be backpropagated: {type(e).__name__}: {e}; {_REST}") from e
    trainable = [p for p in model.parameters() if p.requires_grad]
    if trainable and all(p.grad is None for p in trainable):
        raise DataError(
            "train_step's loss does not depend on the model given to train_step: none of its trainable parameters "
            "got a gradient, and the run would train nothing. Use the model argument, not a model captured from "
            "outside: def train_step(model, batch): x, y = batch; return loss_fn(model(x), y)"
        )


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _shape(entry: Any) -> str:
    if entry is None:
        return "extra state"
    shape, dtype = entry
    return f"{shape} {str(dtype).removeprefix('torch.')}"
