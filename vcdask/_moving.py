"""Batches moved to a worker's device and cast: :func:`to`, for every container kind a ``collate_fn`` makes, and
:func:`same_device`.  :mod:`vcdask.device` gives both under its own names too.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["same_device", "to"]


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
