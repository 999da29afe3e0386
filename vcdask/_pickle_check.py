"""The pre-flight check that what a run sends to its workers can be pickled: :func:`check_picklable`.

A run's spec (:class:`vcdask.spec.RunSpec`) carries the model and the callables the user gave (the loss, the
metrics, the custom steps, the optimizer, ...) and is pickled with cloudpickle once the cluster is up
(:func:`vcdask.spec.save_spec`).  One that cannot be pickled (a closure over a ``threading.Lock``, a model holding
an open file) is refused here instead, before any cluster work and before the store is created, by the option's
name and the object inside it that does not pickle.  The verdict is the run's own pickling (cloudpickle, the model's
modules pickled as their classes pickle them), tensors left out: no weights are copied for it.
:func:`unpicklable_attribute` finds a model's such attribute for :func:`vcdask.device.cpu_copy` too, whose
``copy.deepcopy`` fails on the same objects.
"""

from __future__ import annotations

import functools
import io
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["check_picklable", "unpicklable_attribute"]

# a module's attributes that hold its parameters, buffers and submodules (tensors: they pickle; walked apart)
_MODULE_PARTS = frozenset({"_parameters", "_buffers", "_modules"})
_DEPTH = 4  # how deep the object that does not pickle is looked for (closures of closures, attributes of ...)


def check_picklable(model: torch.nn.Module, options: Mapping[str, Any]) -> None:
    """Refuse a model or an option of ``fit`` that cannot be pickled to the workers, naming what in it does not.

    Parameters
    ----------
    model : torch.nn.Module
        Pickled as the run pickles it, its tensors left out (they pickle): :func:`unpicklable_attribute`.
    options : mapping
        ``fit``'s keyword -> the value it was given (``{"loss": fn, "metrics": [...], ...}``); None, strings and
        numbers are passed over.

    Raises
    ------
    TypeError
        Naming the option (or the model's module and attribute), the object that does not pickle, and the remedy.
    """
    found = unpicklable_attribute(model)
    if found is not None:
        raise TypeError(found)
    for name, value in options.items():
        if value is None or isinstance(value, (str, int, float, bool)):
            continue
        error = _pickle_error(value)
        if error is None:
            continue
        inside = _culprit(value, 0)
        where = f": {inside}" if inside else ""
        raise TypeError(
            f"{name}= cannot be pickled{where} ({type(error).__name__}: {error}); vcdask pickles it (with "
            "cloudpickle) to send it to the workers, once the cluster is up. Create what it holds where it is used "
            "(a lock, an open file, a connection: inside the function, one per process), or define it at the top "
            "level of an importable module, or give its class __getstate__ / __reduce__"
        ) from error


def unpicklable_attribute(model: torch.nn.Module) -> str | None:
    """A message naming what keeps ``model`` from being pickled to the workers, with the remedy; None when it
    pickles.

    The verdict is the run's own pickling (cloudpickle, each module's ``__getstate__`` / ``__reduce__`` of its own
    respected: a ``torch.compile``'d model, a module that leaves its lock out of its state) with the tensors left
    out (:func:`_pickle_error`: the pre-flight pickles no weights).  Only when it fails are the modules walked (in
    ``named_modules()`` order) for the first attribute of the state each pickles that does not pickle."""
    error = _pickle_error(model)
    if error is None:  # (the usual case: one pickling, without the weights)
        return None
    for path, module in model.named_modules():
        where = f"its module {path!r} ({type(module).__name__})" if path else f"the model ({type(module).__name__})"
        for attribute, value in _state(module).items():
            error_here = _pickle_error(value)
            if error_here is None:
                continue
            inside = _culprit(value, 0)
            remedy = (
                f"Leave it out of the state its class's __getstate__ returns (del state[{attribute!r}]; and make "
                "it again in __setstate__)"
                if _own(module, "__getstate__")
                else f"Leave it out of the module's pickled state (def __getstate__(self): state = "
                f"self.__dict__.copy(); del state[{attribute!r}]; return state, and a __setstate__ that makes it "
                "again)"
            )
            return (
                f"the model cannot be pickled to the workers (nor copied for vcdask's checks): {where} holds "
                f"attribute {attribute!r}, {_kind(value)}{f': {inside}' if inside else ''} "
                f"({type(error_here).__name__}: {error_here}). {remedy}, or create it lazily where it is first used"
            )
    return (
        f"the model ({type(model).__name__}) cannot be pickled to the workers (nor copied for vcdask's checks): "
        f"{type(error).__name__}: {error}. vcdask pickles it (with cloudpickle) to send it to the workers: leave "
        "what does not pickle (a lock, an open file, a connection) out of its modules' pickled state "
        "(__getstate__ / __setstate__), or create it lazily where it is first used"
    )


def _own(module: torch.nn.Module, method: str) -> bool:
    """Whether ``module``'s class pickles it its own way (``method`` not torch.nn.Module's, nor object's)."""
    return getattr(type(module), method, None) is not getattr(torch.nn.Module, method, None)


def _state(module: torch.nn.Module) -> dict[str, Any]:
    """The attributes ``module`` pickles (its ``__getstate__``'s, torch.nn.Module's or its class's own) but its
    parameters, buffers and submodules; none for a module whose class has a ``__reduce__`` / ``__reduce_ex__`` of
    its own (what it pickles is its class's to say: its submodules are walked apart)."""
    if _own(module, "__reduce__") or _own(module, "__reduce_ex__"):
        return {}
    try:
        state = module.__getstate__()
    except Exception:  # noqa: BLE001 - a __getstate__ of the user's that fails: its attributes, as they are
        state = vars(module)
    if not isinstance(state, dict):
        return {}
    return {k: v for k, v in state.items() if k not in _MODULE_PARTS}


@functools.cache
def _pickler() -> type:
    """cloudpickle's pickler (the run's, :func:`vcdask.spec.save_spec`) that leaves tensors out: each is pickled as
    a reference (``persistent_id``), so a model's weights are not copied to check that the rest pickles."""
    import cloudpickle

    class _WithoutTensors(cloudpickle.CloudPickler):  # type: ignore[misc, valid-type]
        def persistent_id(self, obj: Any) -> str | None:
            if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
                return "tensor"
            return None

    return _WithoutTensors


def _pickle_error(value: Any) -> Exception | None:
    """What pickling ``value`` as the run pickles it (cloudpickle) raises, its tensors left out; None if nothing."""
    try:
        _pickler()(io.BytesIO()).dump(value)  # (cloudpickle's protocol, as cloudpickle.dumps)
    except Exception as e:  # noqa: BLE001 - whatever pickling raises (TypeError, PicklingError, AttributeError...)
        return e
    return None


def _culprit(value: Any, depth: int) -> str | None:
    """Where in ``value`` the object that does not pickle lies: ``"closure variable 'lock', a _thread.lock"``
    (None when no part of it is found to be it)."""
    if depth >= _DEPTH:
        return None
    for label, part in _parts(value):
        if _pickle_error(part) is None:
            continue
        deeper = _culprit(part, depth + 1)
        return f"{label}, {_kind(part)}" + (f": {deeper}" if deeper else "")
    return None


def _parts(value: Any) -> Iterator[tuple[str, Any]]:
    """What ``value`` pickles with: a function's closure variables and the globals it names, a partial's function
    and arguments, a bound method's object, a container's items, an object's attributes."""
    if isinstance(value, types.FunctionType):
        for name, cell in zip(value.__code__.co_freevars, value.__closure__ or (), strict=False):
            try:
                yield f"closure variable {name!r}", cell.cell_contents
            except ValueError:  # (an empty cell)
                continue
        for name in value.__code__.co_names:
            if name in value.__globals__:
                yield f"global {name!r}", value.__globals__[name]
    elif isinstance(value, functools.partial):
        yield "function", value.func
        yield from ((f"argument {i}", a) for i, a in enumerate(value.args))
        yield from ((f"argument {k}=", v) for k, v in value.keywords.items())
    elif isinstance(value, types.MethodType):
        yield "object", value.__self__
    elif isinstance(value, Mapping):
        yield from ((f"item {k!r}", v) for k, v in value.items())
    elif isinstance(value, (list, tuple, set, frozenset)):
        yield from ((f"item {i}", v) for i, v in enumerate(value))
    elif isinstance(getattr(value, "__dict__", None), dict):
        yield from ((f"attribute {k!r}", v) for k, v in vars(value).items() if k not in _MODULE_PARTS)


def _kind(value: Any) -> str:
    """``"a _thread.lock"``, ``"a function"``: what ``value`` is, for a message."""
    cls = type(value)
    module = "" if cls.__module__ == "builtins" else f"{cls.__module__}."
    return f"a {module}{cls.__qualname__}"
