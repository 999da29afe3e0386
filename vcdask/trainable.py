"""What a model needs for vcdask to train it, checked before any cluster work: parameters to train (one at least,
some of them requiring grad).

:func:`check_trainable` is called by :func:`vcdask.preflight.check_run`; each message names the modules and
parameters at fault and what to change.
"""

from __future__ import annotations

from collections import defaultdict

import torch

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
