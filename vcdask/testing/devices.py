"""A stand-in for an accelerator's tensors on a machine without one, for CPU tests of device rules.

CI has no GPU, and code that mixes devices fails only where there is one: Adam keeps its ``step``
counters on the CPU while its moments live on CUDA, so ``torch.stack`` over the optimizer's state
raised ``Expected all tensors to be on the same device`` on every CUDA worker and on none of CI's.
:class:`OnAccelerator` is a CPU tensor that says it is on ``cuda:0`` and refuses what CUDA refuses:
a torch function that combines it with a tensor of another device (a 0-d CPU tensor in an elementwise
operation excepted, as CUDA allows) raises the same error, and so does ``.numpy()`` (a copy to the
CPU comes first, as on a GPU).  Code under test that groups by
``tensor.device``, or keeps to one tensor at a time, passes as it would on a GPU.

>>> import torch
>>> from vcdask.testing.devices import on_accelerator
>>> a = on_accelerator(torch.ones(2))
>>> a.device
device(type='cuda', index=0)
>>> torch.stack([a, torch.ones(2)])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! ...
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ACCELERATOR", "OnAccelerator", "on_accelerator"]

#: The device an :class:`OnAccelerator` tensor says it is on.
ACCELERATOR = torch.device("cuda", 0)

#: Functions that take tensors of two devices on a GPU too: copies and moves between them, and reading
#: a tensor's own properties.
_CROSSING = {
    "to",
    "copy_",
    "cpu",
    "cuda",
    "__get__",
    "__set__",
    "__repr__",
    "__format__",
    "tolist",
    "_has_compatible_shallow_copy_type",  # (Module.cpu() asks it of each parameter and its moved copy)
}
#: Functions that take several tensors as one list, where even a 0-d tensor of another device is refused.
_LISTS = {"stack", "cat", "concat", "concatenate", "hstack", "vstack", "dstack", "_foreach_add_", "_foreach_mul_"}


def _tensors(value: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)
    return out


class OnAccelerator(torch.Tensor):
    """A CPU tensor standing in for one on :data:`ACCELERATOR` (see the module's docstring).

    The results of torch functions on it are stand-ins too; ``.to("cpu")`` / ``.cpu()`` give plain
    CPU tensors of their own memory, as a real device copy does.
    """

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return ACCELERATOR

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def __deepcopy__(self, memo: dict) -> OnAccelerator:
        """A copy on the same device, as ``copy.deepcopy`` makes of a CUDA tensor (a parameter stays one)."""
        if id(self) in memo:
            return memo[id(self)]
        data = self.as_subclass(torch.Tensor).detach().clone()
        copied = on_accelerator(data)
        if isinstance(self, torch.nn.Parameter):
            copied = torch.nn.Parameter(copied, self.requires_grad)  # type: ignore[assignment]
        memo[id(self)] = copied
        return copied

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "numpy":
            raise TypeError(
                f"can't convert {ACCELERATOR} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                "host memory first. (a stand-in: vcdask.testing.devices)"
            )
        if name not in _CROSSING:
            tensors = _tensors(args, _tensors(kwargs, []))
            other = [
                t
                for t in tensors
                if not isinstance(t, OnAccelerator) and (name in _LISTS or t.dim() > 0 or t.device.type != "cpu")
            ]
            if other and any(isinstance(t, OnAccelerator) for t in tensors):
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, "
                    f"{ACCELERATOR} and {other[0].device}! (a stand-in: vcdask.testing.devices)"
                )
        result = super().__torch_function__(func, types, args, kwargs)
        if name in ("cpu", "tolist") or (name == "to" and _to_cpu(args, kwargs)):
            # (a copy of its own, as a copy from a device is)
            return result.as_subclass(torch.Tensor).clone() if isinstance(result, OnAccelerator) else result
        return result


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call moves to the CPU."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu":
            return True
    return False


def on_accelerator(tensor: torch.Tensor) -> OnAccelerator:
    """``tensor`` (its memory, not a copy) as a stand-in for a tensor on :data:`ACCELERATOR`."""
    return tensor.as_subclass(OnAccelerator)  # type: ignore[return-value]
