"""What a model needs for vcdask to train it, checked before any cluster work: parameters to train (one at least,
some of them requiring grad), a state it can store in a version (:func:`vcdask._dtypes.dtype_name`), and a form it
can copy and send to its workers (no ``torch.nn.utils.parametrize`` parametrizations, which torch pickles only through
``state_dict()``; no tensor attribute computed from the parameters, which ``copy.deepcopy`` refuses, as the older
``torch.nn.utils.weight_norm`` leaves).

:func:`check_trainable` is called by :func:`vcdask.preflight.check_run`; each message names the modules and
parameters at fault and what to change.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.nn.utils import parametrize

from ._dtypes import _DTYPES, dtype_name

__all__ = ["check_trainable"]


def check_trainable(model: torch.nn.Module) -> None:
    """Refuse a model vcdask cannot train, copy, send or store, naming what is at fault and the remedy.

    Parameters
    ----------
    model : torch.nn.Module
        The model as given to ``fit`` (not changed).

    Raises
    ------
    ValueError
        The model holds no parameters, or none that requires grad (every one frozen), or tensors on the ``meta``
        device (without values).
    TypeError
        A state-dict entry that is not a tensor (a module's ``get_extra_state`` returning a dict, an int, ...); a
        parameter or buffer of a dtype no version can store (complex numbers, ...); a module parametrized with
        ``torch.nn.utils.parametrize`` (``parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal``, ...);
        a tensor attribute computed from the parameters (the older ``torch.nn.utils.weight_norm``).
    """
    named = list(model.named_parameters())
    if not named:
        raise ValueError(
            f"the model has no parameters to train ({type(model).__name__} holds no torch.nn.Parameter): vcdask "
            "trains and merges a model's parameters; give it the layers to learn (torch.nn.Linear, ...)"
        )
    _check_materialized(model)
    _check_parametrizations(model)
    _check_computed_attributes(model)
    if not any(p.requires_grad for _, p in named):
        raise ValueError(
            f"no parameter of the model requires grad: all {len(named)} are frozen (requires_grad=False), in "
            f"{_by_module(model, [n for n, _ in named])}, so a task's backward pass has nothing to train (torch: "
            "'element 0 of tensors does not require grad'). Unfreeze what should learn before fit: "
            "model.requires_grad_(True) for the whole model, or model.get_submodule(name).requires_grad_(True) for "
            "the layers to fine-tune (frozen parameters beside them stay as they are)"
        )
    state = model.state_dict()
    _check_tensors_only(state)
    unstorable: list[str] = []
    remedies: dict[str, None] = {}  # (each remedy once, in order)
    for name, t in state.items():
        try:
            dtype_name(t.dtype)
        except TypeError:
            unstorable.append(f"{name} ({str(t.dtype).removeprefix('torch.')})")
            remedies.setdefault(_remedy(t.dtype), None)
    if unstorable:
        raise TypeError(
            f"the model holds {_listed(unstorable)} of a dtype vcdask cannot store in a version; supported dtypes: "
            f"{sorted(_DTYPES)}. {'; '.join(remedies)}"
        )


def _remedy(dtype: torch.dtype) -> str:
    """What to keep a tensor of an unstorable ``dtype`` as instead."""
    name = str(dtype).removeprefix("torch.")
    if dtype.is_complex:
        return (
            "Keep a complex tensor as a real one of its real and imaginary parts, "
            "torch.nn.Parameter(torch.view_as_real(w)) (shape (..., 2)), and make the complex tensor in forward "
            "(torch.view_as_complex(self.w))"
        )
    if name.startswith("uint"):  # (uint16, uint32, uint64: torch's own arithmetic on them is limited too)
        wider = {"uint16": "int32"}.get(name, "int64")
        return (
            f"Keep a {name} tensor as {wider} (t.to(torch.{wider}), which holds its values"
            f"{'' if name != 'uint64' else ' below 2**63'}) and cast it in forward where the {name} matters"
        )
    if dtype.is_floating_point:  # (float8 / float4 variants)
        return (
            f"Keep a {name} tensor in float32 (t.float()) and cast it to {name} in forward where that matters "
            "(for lower-precision arithmetic, precision='bf16' or '16-mixed' runs it with float32 parameters)"
        )
    return f"Keep a {name} tensor as one of the supported dtypes and convert it in forward"


def _check_materialized(model: torch.nn.Module) -> None:
    """Refuse parameters and buffers on the ``meta`` device (shapes without values: a model built under
    ``torch.device("meta")``, or ``init_empty_weights``), which nothing can copy, send or train."""
    meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if meta:
        raise ValueError(
            f"the model's {_listed(meta)} are on the meta device: shapes without values, which no worker can train "
            "(torch: 'Cannot copy out of meta tensor'). Give them values before fit: model.to_empty(device='cpu') "
            "then initialise them (or load_state_dict(..., assign=True) from a checkpoint)"
        )


def _check_tensors_only(state: dict) -> None:
    """Refuse state-dict entries that are not tensors (a module's ``get_extra_state`` returning a dict, an int or a
    str, as torch documents it): a version stores tensors, and the workers load them back into their copies by the
    state dict's names (a dict or a str failed the staging, an int every task on its worker)."""
    found = {name: value for name, value in state.items() if not isinstance(value, torch.Tensor)}
    if not found:
        return
    shown = [f"{name} ({type(value).__name__})" for name, value in found.items()]
    extra = any(name.rpartition(".")[2] == "_extra_state" for name in found)
    raise TypeError(
        f"the model's state_dict() holds {_listed(shown)}, not a tensor"
        f"{' (what get_extra_state() returns)' if extra else ''}: vcdask stores a model's state in each version as "
        "tensors and loads them into the workers' copies by name. Return a tensor from get_extra_state() "
        "(return torch.tensor(self.calls), and self.calls = int(state) in set_extra_state), or keep that state "
        "outside the state_dict (a plain attribute, without get_extra_state / set_extra_state: neither merged nor "
        "returned)"
    )


def _check_parametrizations(model: torch.nn.Module) -> None:
    """Refuse ``torch.nn.utils.parametrize`` parametrizations: torch pickles such a module only through its
    ``state_dict()`` (``Serialization of parametrized modules is only supported through state_dict()``)."""
    found, remedies = [], []
    for path, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for tensor, chain in module.parametrizations.items():
            by = ", ".join(type(p).__name__ for p in chain)
            found.append(f"{_qualified(path, tensor)} (by {by})")
            remedies.append(f"parametrize.remove_parametrizations({_module_expr(path)}, {tensor!r})")
    if found:
        raise TypeError(
            f"the model has parametrized tensors (torch.nn.utils.parametrize): {_listed(found)}. vcdask sends the "
            "model to its workers pickled, and torch pickles a parametrized module only through its state_dict() "
            "('Serialization of parametrized modules is only supported through state_dict()'). Before fit, remove "
            "each parametrization (the tensor keeps its current value as a plain parameter, then trained without "
            f"the constraint): {'; '.join(remedies[:3])}{'; ...' if len(remedies) > 3 else ''} (from torch.nn.utils "
            "import parametrize); or compute the constraint in the module's forward from plain parameters (weight "
            "norm: weight = g * v / v.norm(dim=1, keepdim=True)); spectral norm: the older, hook-based "
            "torch.nn.utils.spectral_norm pickles and trains"
        )


def _check_computed_attributes(model: torch.nn.Module) -> None:
    """Refuse tensor attributes computed from the parameters (not graph leaves), which ``copy.deepcopy`` refuses:
    the older ``torch.nn.utils.weight_norm`` keeps the weight so, recomputed before each forward (and the older
    ``torch.nn.utils.spectral_norm`` after a forward pass that tracked gradients)."""
    found, fixes = [], []
    for path, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        buffers = list(module.named_buffers(recurse=False))
        for name, value in [*vars(module).items(), *buffers]:
            if not isinstance(value, torch.Tensor) or value.is_leaf:
                continue
            found.append(_qualified(path, name))
            if any(name == b for b, _ in buffers):
                fixes.append(f"register the buffer {_qualified(path, name)} detached (.detach())")
            if f"{name}_g" in params and f"{name}_v" in params:
                fixes.append(
                    f"{_qualified(path, name)} is torch.nn.utils.weight_norm's: remove it before fit, "
                    f"torch.nn.utils.remove_weight_norm({_module_expr(path)}, {name!r}) (the weight keeps its value)"
                )
            elif f"{name}_orig" in params:
                fixes.append(
                    f"{_qualified(path, name)} is torch.nn.utils.spectral_norm's: run the model once under "
                    "torch.no_grad() before fit, which recomputes it as a plain tensor"
                )
    if found:
        lead = "; ".join(fixes[:3]) + "; or compute" if fixes else "Compute"
        raise TypeError(
            f"the model holds {_listed(found)} as a tensor computed from its parameters, which cannot be copied "
            "(torch: 'Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol'), "
            f"and vcdask copies the model for its checks and its workers. {lead} such tensors in the module's "
            "forward from plain parameters (weight norm: weight = g * v / v.norm(dim=1, keepdim=True)) instead of "
            "keeping them on the module"
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


def _qualified(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _module_expr(path: str) -> str:
    return f"model.get_submodule({path!r})" if path else "model"


def _listed(items: list[str]) -> str:
    return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
