"""Where a shard trains and in what precision.

The client checks the ``device`` and ``precision`` options of :func:`vcdask.fit` (:func:`check_device`,
:func:`check_precision`); each worker then resolves ``device`` against what it has
(:func:`resolve_device`: ``"auto"`` takes the worker's accelerator), so one run can mix GPU and CPU
workers.  Parameters travel and merge as CPU flat arrays; a worker moves them to its device, trains
under :class:`Precision` and brings ``W_c`` back to CPU.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import re
from collections.abc import Iterator
from typing import Any

import torch

from ._moving import same_device, to
from .errors import DeviceUnavailableError

__all__ = [
    "DEVICES",
    "PRECISIONS",
    "Precision",
    "check_device",
    "check_precision",
    "cpu_copy",
    "describe",
    "resolve_device",
    "same_device",
    "to",
]

#: What ``device=`` accepts (``"cuda:N"`` names one GPU of the worker's machine).
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")

#: What ``precision=`` accepts, and aliases in Lightning's spelling.
PRECISIONS = ("32", "bf16", "16-mixed")
_PRECISION_ALIASES = {"32": "32", "32-true": "32", "bf16": "bf16", "bf16-mixed": "bf16", "16-mixed": "16-mixed"}


def check_device(device: Any) -> str:
    """``device`` as the string every worker resolves; raise if it names no kind of device.

    ``"mps:0"`` (``torch.device("mps", 0)``) is ``"mps"``, ``"cpu:0"`` is ``"cpu"``: a machine has one of each.
    ``"cuda:N"`` is spelled as torch spells it (``"cuda:01"`` is refused: torch refuses it on every worker).

    Raises
    ------
    ValueError
        Naming the bad value and the valid choices.
    """
    if isinstance(device, torch.device):
        device = str(device)
    for one in ("mps", "cpu"):  # (torch.device("cpu", 0) is "cpu:0")
        if isinstance(device, str) and device == f"{one}:0":
            return one
        if isinstance(device, str) and re.fullmatch(rf"{one}:\d+", device):
            raise ValueError(f"device {device!r}: a machine has one {one.upper()} device, {one!r} (or '{one}:0')")
    if isinstance(device, str) and (
        device in ("auto", "cpu", "cuda", "mps") or re.fullmatch(r"cuda:(0|[1-9]\d*)", device)
    ):
        return device
    raise ValueError(f"device must be one of {list(DEVICES)} (or a torch.device), got {device!r}")


def check_precision(precision: Any) -> str:
    """``precision`` in its canonical spelling (``"32"``, ``"bf16"`` or ``"16-mixed"``).

    Raises
    ------
    ValueError
        Naming the bad value and the valid choices.
    """
    key = str(precision) if isinstance(precision, (str, int)) and not isinstance(precision, bool) else None
    if key not in _PRECISION_ALIASES:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return _PRECISION_ALIASES[key]


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(device: str, where: str = "this worker") -> torch.device:
    """The torch device this process trains on for the option ``device``.

    ``"auto"`` is the worker's CUDA device if it has one (``torch.cuda.current_device()``, which
    ``CUDA_VISIBLE_DEVICES`` or dask-cuda choose per worker), else Apple's MPS, else the CPU.
    ``where`` names this process in the errors (``"this process"`` for a prediction).

    Raises
    ------
    DeviceUnavailableError
        An explicit ``"cuda"`` / ``"mps"`` on a worker without one (a ``RuntimeError``): the run gives that
        worker no more shards and sends the shard elsewhere.
    """
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"device={device!r} but {where} has no CUDA device (torch {torch.__version__})"
            )
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"device={device!r} but {where} has {torch.cuda.device_count()} CUDA device(s)"
            )
        return torch.device("cuda", index)
    if dev.type == "mps" and not _mps_available():
        raise DeviceUnavailableError(f"device={device!r} but {where} has no MPS device")
    return dev


def describe(device: torch.device) -> str:
    """A short name for the worker table, e.g. ``"cuda:0 (NVIDIA H100 80GB HBM3)"`` or ``"cpu"``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` with every parameter and buffer on the CPU, made without a second copy on
    the model's own device (a CUDA model's copy is never allocated on its GPU).

    Parameters stay :class:`torch.nn.Parameter` with their ``requires_grad``, without gradients; tied
    parameters stay tied.  The client runs its checks and stages the run's model this way: the data it probes
    with is on the CPU, and what travels to the workers is a CPU model whatever device the caller's is on.

    Raises
    ------
    TypeError
        A module attribute that cannot be copied (a ``threading.Lock``, an open file): the message names the
        module and the attribute, and the remedy (:func:`vcdask._pickle_check.unpicklable_attribute`).
    """
    memo: dict[int, Any] = {}  # (deepcopy takes what it finds here instead of copying it)
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.device.type == "cpu" or id(t) in memo or torch.nn.parameter.is_lazy(t):
            continue  # (copied as deepcopy copies it)
        moved = t.detach().cpu()
        # (a Parameter as Module.cpu() makes one)
        memo[id(t)] = torch.nn.Parameter(moved, t.requires_grad) if isinstance(t, torch.nn.Parameter) else moved
    try:
        return copy.deepcopy(model, memo).cpu()
    except Exception as e:  # an attribute deepcopy cannot copy (a lock, an open file): named, when it is one
        from ._pickle_check import unpicklable_attribute

        found = unpicklable_attribute(model)
        if found is None:
            raise
        raise TypeError(found) from e


def loss_tensors(loss: Any) -> list[torch.Tensor]:
    """The tensors a loss carries: a module's parameters and buffers, a :func:`functools.partial`'s tensor
    arguments (its function's too, a partial or a module)."""
    if isinstance(loss, torch.nn.Module):
        return [*loss.parameters(), *loss.buffers()]
    if isinstance(loss, functools.partial):
        given = [*loss.args, *loss.keywords.values()]
        return [*loss_tensors(loss.func), *(a for a in given if isinstance(a, torch.Tensor))]
    return []


def loss_to(loss: Any, device: torch.device) -> Any:
    """A copy of ``loss`` whose tensors (:func:`loss_tensors`) are on ``device``, the partial rebuilt around them
    (a module copied to the CPU by :func:`cpu_copy`: never a second copy on its GPU); a plain function as it is."""
    if isinstance(loss, torch.nn.Module):
        return cpu_copy(loss) if device.type == "cpu" else copy.deepcopy(loss).to(device)
    if isinstance(loss, functools.partial):
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in loss.args]
        keywords = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in loss.keywords.items()}
        return functools.partial(loss_to(loss.func, device), *args, **keywords)
    return loss


class Precision:
    """Autocast and (for fp16) gradient scaling around a training step.

    Parameters
    ----------
    precision : {"32", "bf16", "16-mixed"}
        ``"bf16"`` runs the forward pass under ``torch.autocast(dtype=torch.bfloat16)`` (parameters
        stay float32); ``"16-mixed"`` under float16 autocast with a :class:`torch.amp.GradScaler`.
    device : torch.device
    """

    def __init__(self, precision: str, device: torch.device):
        self.precision = precision
        self.device = device
        self.dtype = {"bf16": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward pass's context (a no-op in full precision)."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype):
            yield

    def step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, clip_grad_norm: float | None) -> None:
        """Backward pass, optional gradient clipping (on unscaled gradients), optimizer step."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.scaler is None:
            loss.backward()
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
            optimizer.step()
            return
        self.scaler.scale(loss).backward()
        if clip_grad_norm is not None:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        self.scaler.step(optimizer)
        self.scaler.update()
