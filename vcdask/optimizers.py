"""The inner optimizer as ``fit`` takes it (``optimizer=``, ``lr=``), made into ``params -> optimizer`` and checked
before any cluster work.

Each worker builds the optimizer on its own copy of the model, as ``optimizer(params)`` with ``params`` a list of
that copy's parameters in ``model.parameters()`` order: a factory that refers to the caller's model (a closure
``lambda params: AdamW(model[0].parameters())``) makes an optimizer over parameters no task trains, and every
update would equal its base.  :func:`check_inner_optimizer` builds it once, on a CPU copy, and refuses that, a
optimizer whose ``step`` needs a closure (LBFGS) and an ``lr=`` the factory would ignore, and warns of a trainable
parameter in no group (it gets gradients but no step: a factory that trains the head only).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import torch

from ._stack import user_level
from .device import cpu_copy
from .groups import Training, check_optimizer

__all__ = ["DEFAULT_LR", "check_inner_optimizer", "describe_optimizer", "resolve_optimizer"]

#: ``fit``'s default ``lr``: another value was given on purpose (and must be applied, or refused).
DEFAULT_LR: float = cast(float, next(f.default for f in dataclasses.fields(Training) if f.name == "lr"))


def _optimizer_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)


def _class_partial(obj: Any) -> bool:
    """A ``functools.partial`` of an optimizer class with keywords only (``partial(SGD, momentum=0.9)``)."""
    return isinstance(obj, functools.partial) and _optimizer_class(obj.func) and not obj.args


def describe_optimizer(optimizer: Any) -> str:
    """``optimizer=`` as a message names it: ``torch.optim.SGD``, ``functools.partial(torch.optim.SGD,
    momentum=0.9)``, ``make_opt``, ``<lambda>``."""
    if isinstance(optimizer, type):
        module = optimizer.__module__
        module = "torch.optim" if module.startswith("torch.optim.") else module
        return f"{module}.{optimizer.__qualname__}"
    if isinstance(optimizer, functools.partial):
        given = [describe_optimizer(optimizer.func), *map(repr, optimizer.args)]
        given += [f"{k}={v!r}" for k, v in optimizer.keywords.items()]
        return f"functools.partial({', '.join(given)})"
    return getattr(optimizer, "__name__", None) or type(optimizer).__name__


def resolve_optimizer(optimizer: Any, lr: float) -> Callable[..., torch.optim.Optimizer]:
    """``params -> optimizer`` for ``fit``'s ``optimizer=`` and ``lr=``.

    ``lr`` is applied to the default Adam, to an optimizer class and to a ``functools.partial`` of one that sets
    no ``lr`` of its own.  Another callable is taken as it is (:func:`check_inner_optimizer` refuses an ``lr``
    it would ignore).

    Raises
    ------
    TypeError
        Not None, an optimizer class or a callable.
    ValueError
        A partial that sets ``lr`` and an ``lr=`` that differs (both named).
    """
    if optimizer is None:
        return functools.partial(torch.optim.Adam, lr=lr)
    if _optimizer_class(optimizer):
        return functools.partial(optimizer, lr=lr)  # type: ignore[call-arg]  # every torch optimizer takes lr
    if _class_partial(optimizer):
        own = optimizer.keywords.get("lr")
        if own is None:
            return functools.partial(optimizer, lr=lr)
        if lr != DEFAULT_LR and own != lr:
            raise ValueError(
                f"lr={lr!r} and optimizer={describe_optimizer(optimizer)} both set the learning rate: pass it once, "
                f"as lr= (functools.partial({describe_optimizer(optimizer.func)}, ...) without lr) or in the partial"
            )
        return optimizer
    check_optimizer(optimizer)
    return optimizer


def check_inner_optimizer(
    make: Callable, model: torch.nn.Module, *, given: Any, lr: float, clip_grad_norm: float | None = None
) -> None:
    """Build ``make(params)`` on a CPU copy of ``model``, as each worker does on its copy, and refuse what would
    train wrong or fail on the cluster.

    Parameters
    ----------
    make : callable
        ``params -> optimizer`` (:func:`resolve_optimizer`).
    model : torch.nn.Module
        The model as given to ``fit`` (not changed).
    given : optimizer class, callable or None
        ``fit``'s ``optimizer=``, as the messages name it.
    lr : float
        ``fit``'s ``lr=``.
    clip_grad_norm : float, optional
        ``fit``'s ``clip_grad_norm=``: checked against the sparse gradients of the model's embeddings.

    Raises
    ------
    ValueError
        The optimizer holds parameters that are not the copy's (a closure over the caller's model), needs a
        closure at every step (LBFGS), or a factory uses an ``lr=`` that is not the default in none of its groups;
        ``make`` raised a ``ValueError`` (or another error but a ``TypeError``); the model has embeddings with
        sparse gradients (``torch.nn.Embedding(sparse=True)``, ``EmbeddingBag``) that the optimizer's step or the
        clipping cannot take (Adam, AdamW, SparseAdam beside dense layers, SGD with weight decay; any
        ``clip_grad_norm``).
    TypeError
        ``make`` does not return a ``torch.optim.Optimizer``, or raised a ``TypeError``.

    Warns
    -----
    UserWarning
        Trainable parameters are in no group: they get gradients but no step (freeze them to skip their backward).
    """
    name = "Adam (the default)" if given is None else describe_optimizer(given)
    copy_ = cpu_copy(model)
    params = list(copy_.parameters())
    try:
        optimizer = make(list(params))
    except Exception as e:
        error = TypeError if isinstance(e, TypeError) else ValueError
        raise error(
            f"optimizer={name} cannot be made from the model's parameters (optimizer(params), params a list of "
            f"them): {type(e).__name__}: {e}"
        ) from e
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer={name} must make a torch.optim.Optimizer from the params it is given, "
            f"got {type(optimizer).__name__}"
        )
    if _needs_closure(optimizer):
        raise ValueError(
            f"optimizer={name}: {type(optimizer).__name__}.step needs a closure that evaluates the loss again, "
            "which a shard task's step (backward, clip, optimizer.step()) does not give; use an optimizer that "
            "steps from the gradients (torch.optim.Adam, AdamW, SGD, ...)"
        )
    _check_groups(optimizer, copy_, model, name)
    _check_sparse_gradients(optimizer, copy_, name, clip_grad_norm)
    if lr != DEFAULT_LR and not (given is None or _optimizer_class(given) or _class_partial(given)):
        rates = sorted({float(group["lr"]) for group in optimizer.param_groups if "lr" in group})
        if not any(math.isclose(rate, lr, rel_tol=1e-6) for rate in rates):  # (a base rate beside a group's own)
            raise ValueError(
                f"lr={lr!r} cannot be applied to optimizer={name}, a function that makes its optimizer with its own "
                f"learning rate{'s' if len(rates) > 1 else ''} ({', '.join(map(repr, rates))}): set it in the "
                "function, or pass a class with lr= (optimizer=torch.optim.AdamW, lr=...) or a partial without lr "
                "(optimizer=functools.partial(torch.optim.AdamW, weight_decay=0.01), lr=...)"
            )


def _check_sparse_gradients(
    optimizer: torch.optim.Optimizer, copy_: torch.nn.Module, name: str, clip_grad_norm: float | None
) -> None:
    """Embeddings with sparse gradients (``torch.nn.Embedding(sparse=True)``, ``EmbeddingBag``) take one step of
    the optimizer (and the clipping, with ``clip_grad_norm``), as a task takes it, on the CPU copy: a sparse gradient
    on their weights, a dense one on one other parameter (SparseAdam refuses those), none elsewhere (no state is
    made for the rest).  Most optimizers refuse sparse gradients (Adam: 'Adam does not support sparse gradients'),
    and so does the clipping ('aten::linalg_vector_norm' on 'SparseCPU'): every task failed on the cluster."""
    holders = Counter(id(p) for m in copy_.modules() for p in m.parameters(recurse=False))
    sparse = {  # (a weight tied to another layer's, an output layer's, gets dense gradients: sparse + dense)
        path: module
        for path, module in copy_.named_modules()
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))
        and module.sparse
        and module.weight.requires_grad
        and holders[id(module.weight)] == 1
    }
    if not sparse:
        return
    modules = _names([f"{path or 'the model itself'} ({type(m).__name__}(sparse=True))" for path, m in sparse.items()])
    sparse_ids = {id(m.weight) for m in sparse.values()}
    dense = [p for p in copy_.parameters() if p.requires_grad and id(p) not in sparse_ids]
    stepped = [m.weight for m in sparse.values()] + sorted(dense, key=torch.Tensor.numel)[:1]
    with torch.no_grad():
        for p in copy_.parameters():
            p.grad = None
        for t in stepped:
            if id(t) in sparse_ids:  # (as an embedding's backward gives it: the rows of the ids it looked up)
                ids = torch.zeros((1, 1), dtype=torch.long)
                t.grad = torch.sparse_coo_tensor(ids, torch.zeros_like(t[:1]), t.shape, check_invariants=True)
            else:
                t.grad = torch.zeros_like(t)
    dense_fix = "pass sparse=False to the embedding (dense gradients, which every optimizer and the clipping take)"
    if clip_grad_norm is not None:
        try:
            torch.nn.utils.clip_grad_norm_(stepped, clip_grad_norm)
        except Exception as e:  # (torch's refusal, said with the remedy)
            raise ValueError(
                f"clip_grad_norm={clip_grad_norm!r} cannot clip the sparse gradients of {modules} "
                f"({_said(e)}), and every task would fail on the cluster: "
                f"{dense_fix}, or leave clip_grad_norm unset (with optimizer=torch.optim.SGD or Adagrad, which "
                "take sparse gradients)"
            ) from e
    try:
        with warnings.catch_warnings():  # (torch's own notes on sparse tensors, for a step on a copy)
            warnings.simplefilter("ignore")
            optimizer.step()
    except Exception as e:  # (the step every task would take, said with the remedy)
        raise ValueError(
            f"optimizer={name} cannot step the sparse gradients of {modules} ({_said(e)}), and every task would "
            f"fail on the cluster: {dense_fix}, or pass an "
            "optimizer that takes sparse gradients beside dense ones: optimizer=torch.optim.SGD (without "
            "weight_decay) or torch.optim.Adagrad"
        ) from e


def _said(e: Exception) -> str:
    """An error's type and first sentence (torch's dispatcher lists every backend after it)."""
    first = (str(e).strip().splitlines() or [""])[0].split(". ")[0]
    return f"{type(e).__name__}: {first}"


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes a closure it cannot do without (LBFGS: ``step(closure)``)."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # (a step without a signature: taken as one that steps from the gradients)
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _check_groups(optimizer: torch.optim.Optimizer, copy_: torch.nn.Module, model: torch.nn.Module, name: str) -> None:
    """The optimizer's groups hold the copy's parameters only (by identity); a trainable one in none is said."""
    names = {id(p): n for n, p in copy_.named_parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    held_ids = {id(p) for p in held}
    foreign = [p for p in held if id(p) not in names]
    idle = [n for n, p in copy_.named_parameters() if p.requires_grad and id(p) not in held_ids]
    order = list(names.values())
    layout = (
        f"params is a list of the model's parameters in model.named_parameters() order ({_names(order, shown=6)}): "
        "params[i:j] picks a layer's, [p for p in params if p.ndim < 2] its biases and norms"
    )
    untrained = f"{len(idle)} trainable parameters are in no group of the optimizer ({_names(idle)})"
    if foreign:
        yours = {id(p): n for n, p in model.named_parameters()}
        mine = [yours[id(p)] for p in foreign if id(p) in yours]
        whose = f"your model's {_names(mine)} (a closure over your model?)" if mine else "not the model's"
        raise ValueError(
            f"optimizer={name}: the optimizer holds {len(foreign)} parameters that are not those it was given: "
            f"{whose}. Each worker builds the optimizer on its own copy of the model, as optimizer(params), and "
            f"trains only what it holds{f', so {untrained}' if idle else ''}; build the groups from the params "
            f"argument. {layout}"
        )
    if idle:  # (fine-tuning a head only is torch's own idiom: said, not refused)
        warnings.warn(
            f"optimizer={name}: {untrained}: they get gradients but no step, and keep the values you gave them; "
            "freeze them before fit (requires_grad_(False)) to skip their backward, or put them in a group. "
            f"{layout}",
            UserWarning,
            stacklevel=user_level(),  # (fit's caller)
        )


def _names(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
