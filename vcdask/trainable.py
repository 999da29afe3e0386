"""What a model needs for vcdask to train it, checked before any cluster work: parameters to train (one at least,
some of them requiring grad) and a state it can store in a version (:func:`vcdask._dtypes.dtype_name`).

:func:`check_trainable` is called by :func:`vcdask.preflight.check_run`; each message names the modules and
parameters at fault and what to change.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ._dtypes import _DTYPES, dtype_name

__all__ = ["check_trainable"]


def check_trainable(model: torch.nn.Module) -> None:
    """Refuse a model vcdask cannot train, naming what is at fault and the remedy.

    Parameters
    ----------
    model : torch.nn.Module
        The model as given to ``fit`` (not changed).

    Raises
    ------
    ValueError
        The model holds no parameters, or none that requires grad (every one frozen).
    TypeError
        A parameter or buffer of a dtype no version can store (complex numbers, ...).
    """
    named = list(model.named_parameters())
    if not named:
        raise ValueError(
            f"the model has no parameters to train ({type(model).__name__} holds no torch.nn.Parameter): vcdask "
            "trains and merges a model's parameters; give it the layers to learn (torch.nn.Linear, ...)"
        )
    if not any(p.requires_grad for _, p in named):
        raise ValueError(
            f"no parameter of the model requires grad: all {len(named)} are frozen (requires_grad=False), in "
            f"{_by_module(model, [n for n, _ in named])}, so a task's backward pass has nothing to train (torch: "
            "'element 0 of tensors does not require grad'). Unfreeze what should learn before fit: "
            "model.requires_grad_(True) for the whole model, or model.get_submodule(name).requires_grad_(True) for "
            "the layers to fine-tune (frozen parameters beside them stay as they are)"
        )
    unstorable = []
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor):
            try:
                dtype_name(t.dtype)
            except TypeError:
                unstorable.append(f"{name} ({str(t.dtype).removeprefix('torch.')})")
    if unstorable:
        raise TypeError(
            f"the model holds {_listed(unstorable)} of a dtype vcdask cannot store in a version; supported dtypes: "
            f"{sorted(_DTYPES)}. Keep a complex parameter as a real one of its real and imaginary parts, "
            "torch.nn.Parameter(torch.view_as_real(w)) (shape (..., 2)), and make the complex tensor in forward "
            "(torch.view_as_complex(self.w))"
        )


def _by_module(model: torch.nn.Module, names: list[str]) -> str:
    """Parameter names grouped by the module holding them: ``0 (Linear: weight, bias), 2 (Linear: weight)``."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in names:
        path, _, leaf = name.rpartition(".")
        groups[path].append(leaf)
    shown = [
        f"{path or 'the model itself'} ({type(model.get_submodule(path)).__name__}: {', '.join(leaves)})"
        for path, leaves in list(groups.items())[:4]
    ]
    return ", ".join(shown) + (f" and {len(groups) - 4} more modules" if len(groups) > 4 else "")


def _listed(items: list[str]) -> str:
    return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
