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
import dataclasses
import functools
import itertools
import re
import types
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

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


def to(batch: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """``batch`` on ``device``, every container in it of its own type; floating tensors take ``dtype`` when given.
    Copies from pinned memory do not block.

    A batch is what a ``collate_fn`` makes: tensors in tuples, lists and dicts (walked first, fast), or in
    namedtuples, other ``Mapping`` types (an ``OrderedDict``, a ``UserDict``), dataclasses (frozen too) and
    ``types.SimpleNamespace``, rebuilt as torch's ``default_collate`` and ``pin_memory`` rebuild them (``batch.x``
    works in the step).  An object with a ``.to`` of its own moves itself (``obj.to(device)``, as in Lightning's
    ``move_data_to_device``); a ``Mapping`` (a ``BatchFeature``, a ``TensorDict``) is then walked to cast it, a
    namedtuple (a ``PackedSequence``) has its floating fields cast, any other (a tensorclass, your own class) keeps
    its dtypes (vcdask cannot make it again; its ``.to(dtype)`` may cast integers too).  A ``.to`` that raises or
    returns another kind of thing (a unit's ``.to(unit)``) is no move.  Leaves (strings, numbers) are returned as
    they are, and so is any other object whose tensors are all on ``device``, in the dtype asked for.

    Raises
    ------
    TypeError
        An object holding tensors in its attributes that must move or be cast but that is none of these (vcdask
        can neither move nor rebuild it; they would stay on a GPU worker's CPU): naming its type and the remedy.
    """
    cls = type(batch)
    if cls is torch.Tensor:
        if dtype is not None and batch.dtype != dtype and batch.is_floating_point():
            batch = batch.to(dtype)
        return batch.to(device, non_blocking=batch.is_pinned())
    if cls is dict:
        return {k: to(v, device, dtype) for k, v in batch.items()}
    if cls is tuple:
        return tuple([to(v, device, dtype) for v in batch])
    if cls is list:
        return [to(v, device, dtype) for v in batch]
    return _to_other(batch, device, dtype)


_LEAVES = (str, bytes, int, float, complex, type(None))


def _to_other(batch: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """:func:`to` for what is not a plain tensor, tuple, list or dict."""
    if isinstance(batch, _LEAVES) or isinstance(batch, type):
        return batch
    if isinstance(batch, torch.Tensor):  # a subclass (a Parameter): as a tensor
        if dtype is not None and batch.dtype != dtype and batch.is_floating_point():
            batch = batch.to(dtype)
        return batch.to(device, non_blocking=batch.is_pinned())
    failed = None
    move = getattr(batch, "to", None)
    if callable(move):
        moved, failed = _own_to(batch, move, device)
        if failed is None and not isinstance(moved, Mapping):
            return _cast_fields(moved, dtype)
        batch = moved  # (a Mapping moved by its own .to is walked to cast it; one whose .to failed, to move it)
    if isinstance(batch, Mapping):
        return _mapping(batch, {k: to(v, device, dtype) for k, v in batch.items()})
    if isinstance(batch, tuple):
        items = [to(v, device, dtype) for v in batch]
        if hasattr(batch, "_fields"):  # a namedtuple: its fields are its arguments
            return type(batch)(*items)
        try:
            return type(batch)(items)
        except TypeError:
            return tuple(items)
    if isinstance(batch, list):
        return _list(batch, [to(v, device, dtype) for v in batch])
    if dataclasses.is_dataclass(batch):
        return _dataclass(batch, device, dtype)
    if isinstance(batch, types.SimpleNamespace):  # its attributes are its items
        clone = copy.copy(batch)
        clone.__dict__.update({k: to(v, device, dtype) for k, v in vars(batch).items()})
        return clone
    held = _unmoved_attributes(batch, device, dtype)
    if held:
        cast = f" or cast to {dtype}" if dtype is not None else ""
        why = f"raised {type(failed).__name__}: {failed}" if isinstance(failed, Exception) else failed
        why = f"; its own .to(device) {why}" if failed is not None else ""
        raise TypeError(
            f"a batch holds a {type(batch).__module__}.{type(batch).__qualname__} with tensors in its attributes "
            f"({', '.join(held)}), which vcdask can neither move to the worker's device ({device}){cast} nor "
            "rebuild: return a tuple, dict, namedtuple, dataclass or SimpleNamespace of tensors from collate_fn (or "
            f"give the class a .to(device) method that returns it on that device){why}"
        ) from (failed if isinstance(failed, Exception) else None)
    return batch  # (its tensors, if any, are where they must be, in the dtype asked for)


def _own_to(batch: Any, move: Any, device: torch.device) -> tuple[Any, Exception | str | None]:
    """``batch.to(device)`` and ``None``, or ``batch`` and why that is no move: what it raised (a unit's
    ``.to(unit)``), or what it returned if neither ``None`` (a move in place) nor an object of ``batch``'s kind."""
    try:
        moved = move(device)
    except torch.OutOfMemoryError:  # (a move that ran out of memory)
        raise
    except Exception as e:  # noqa: BLE001 - a .to of another kind (a unit's): handled as an object without one
        return batch, e
    if moved is None:  # (a .to that moves in place returns nothing)
        return batch, None
    if isinstance(moved, type(batch)) or (isinstance(batch, type(moved)) and type(moved) not in (object, *_LEAVES)):
        return moved, None  # (or a base class's: a BatchFeature subclass's .to may return a BatchFeature)
    return batch, f"returned a {type(moved).__module__}.{type(moved).__qualname__}"


def _cast_fields(moved: Any, dtype: torch.dtype | None) -> Any:
    """``moved`` (moved by its own ``.to``) with floating fields in ``dtype`` if a namedtuple (a ``PackedSequence``),
    made by ``_replace``, not its constructor (which may check them); any other object as it is."""
    if dtype is None or not (isinstance(moved, tuple) and hasattr(moved, "_fields") and hasattr(moved, "_replace")):
        return moved
    fields = zip(moved._fields, moved, strict=True)
    cast = {k: v.to(dtype) for k, v in fields if isinstance(v, torch.Tensor) and v.is_floating_point()}
    return moved._replace(**cast) if cast else moved


def _mapping(m: Mapping, items: dict) -> Any:
    """``m``'s type holding ``items``: a copy updated (a mutable mapping may carry more than its items), else one
    made from them; a plain dict where the type can do neither (as torch's ``pin_memory`` does)."""
    try:
        if isinstance(m, MutableMapping):
            clone = copy.copy(m)
            clone.update(items)
            return clone
        return type(m)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def _list(seq: list, items: list) -> Any:
    """A list subclass's copy holding ``items``; a plain list where it cannot be copied."""
    try:
        clone = copy.copy(seq)
        clone[:] = items
        return clone
    except TypeError:
        return items


def _dataclass(obj: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """A copy of dataclass ``obj`` whose fields (``init=False`` ones too) are on ``device``: set on a shallow copy,
    frozen or not, so ``__post_init__`` does not run a second time on values it already made."""
    clone = copy.copy(obj)
    for f in dataclasses.fields(obj):
        if hasattr(obj, f.name):  # (an init=False field without a default may be unset)
            object.__setattr__(clone, f.name, to(getattr(obj, f.name), device, dtype))
    return clone


def _unmoved_attributes(obj: Any, device: torch.device, dtype: torch.dtype | None) -> list[str]:
    """The attributes of ``obj`` (its ``__dict__`` and slots) holding a tensor, or a tuple, list or dict of them,
    that is not on ``device`` or is floating and not of ``dtype`` (when given)."""
    names = dict(getattr(obj, "__dict__", None) or {})
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                names[name] = getattr(obj, name)

    def unmoved(t: Any) -> bool:
        cast = dtype is not None and isinstance(t, torch.Tensor) and t.dtype != dtype and t.is_floating_point()
        return isinstance(t, torch.Tensor) and (cast or not same_device(t.device, device))

    def held(v: Any) -> Any:
        return v.values() if isinstance(v, dict) else v if isinstance(v, (tuple, list)) else (v,)

    return [name for name, v in names.items() if any(unmoved(t) for t in held(v))]


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` name one device: ``"cuda"`` is the current CUDA device, ``"mps"`` is ``mps:0``
    (``torch.device("cuda") != torch.device("cuda:0")``, though a tensor made on the first is on the second)."""

    def index(d: torch.device) -> int | None:
        if d.index is not None or d.type == "cpu":
            return d.index
        return torch.cuda.current_device() if d.type == "cuda" else 0

    return a.type == b.type and index(a) == index(b)


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
