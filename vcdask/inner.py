"""The inner (local) optimizer of shard tasks: fresh or kept per worker, learning-rate schedules.

``optimizer_state="fresh"`` (the paper's rule) makes a new optimizer for every shard task.
``"worker"`` keeps each worker's optimizer state (Adam's moments, momentum buffers, the fp16 grad
scaler) between its tasks of one run, as DiLoCo keeps its workers' inner AdamW: the state lives in the
worker process, keyed by run, so a shard re-issued to another worker starts clean there, and a worker
that restarts starts clean.  Tasks running at once on one worker never share a state.  With either, a
task in fp16 (``precision="16-mixed"``) starts from the loss scale its worker's last task of the run ended
with, not from torch's initial one.
``"auto"`` (the default) is decided when the run starts (:func:`resolve_optimizer_state`): ``"worker"``
when a task takes at least as many local steps as its optimizer's first moment remembers
(``1 / (1 - beta1)``: 10 for Adam's defaults), ``"fresh"`` otherwise.  A kept first moment points where
the worker's previous task was heading, from a base the server has moved on from; over a short task it is
most of the update, and it adds its own momentum to the outer rule's.  ``benchmarks/defaults.py`` and
``benchmarks/heterogeneous.py`` chose the default: see ``docs/user-guide/merge-rules.md``.

``lr_schedule=fn(epoch, step) -> factor`` scales the optimizer's learning rate(s) at every local
step: ``epoch`` is the run's epoch (1-based) and ``step`` the task's local step (0-based), so warm-up
over local steps and decay over epochs are both one line.  A :class:`vcdask.lr_schedules.RunSchedule`
(``Cosine``, ``Linear``, ``Constant``, ``OverRun``) is indexed instead by the run's global count of
local steps: the task's place in the run (``position``, from the run) times a shard's steps, plus its own.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from ._ints import is_real
from .lr_schedules import RunSchedule, run_steps

__all__ = [
    "OPTIMIZER_STATES",
    "InnerOptimizer",
    "check_optimizer_state",
    "check_schedule",
    "forget",
    "memory_steps",
    "resolve_optimizer_state",
]

#: What ``optimizer_state=`` accepts.
OPTIMIZER_STATES = ("auto", "fresh", "worker")

_lock = threading.Lock()
_kept: dict[str, list[dict[str, Any]]] = {}  # run_id -> states set aside by finished tasks (newest run last)
# run_id -> the fp16 grad scaler's state after this process's last finished task of the run, whatever
# ``optimizer_state``: the loss scale it found is the model's, not the optimizer's, and a task that started
# again from torch's 65536 would skip its first steps to overflows (all of a short task's, on some models)
_scales: dict[str, dict[str, Any]] = {}
_KEEP_RUNS = 4


def check_optimizer_state(value: Any) -> str:
    if value not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_state must be one of {list(OPTIMIZER_STATES)}, got {value!r}")
    return value


def memory_steps(optimizer: torch.optim.Optimizer) -> float:
    """How many steps ``optimizer``'s first moment remembers: ``1 / (1 - beta1)``.

    ``beta1`` is the first of ``betas`` (Adam, AdamW, NAdam, ...) or ``momentum`` (SGD, RMSprop) of its
    first parameter group; an optimizer with neither (or with 0) remembers one step.  One whose groups
    cannot be read this way is taken to remember forever (``"auto"`` then starts each task fresh).
    """
    try:
        group = optimizer.param_groups[0]
        beta = float(group["betas"][0] if "betas" in group else group.get("momentum", 0.0))  # a tensor too
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return math.inf
    return math.inf if beta >= 1.0 else 1.0 / (1.0 - max(beta, 0.0))


def resolve_optimizer_state(value: str, optimizer: torch.optim.Optimizer, steps_per_task: int) -> str:
    """``"fresh"`` or ``"worker"`` for a run whose shortest task takes ``steps_per_task`` local steps.

    ``"auto"`` keeps each worker's state when ``steps_per_task >= memory_steps(optimizer)``: the task
    outlasts what its first moment remembers of the worker's previous task.  Measured
    (``docs/user-guide/merge-rules.md``): on digits and the wide CNN (12 Adam steps per task) the kept
    state reaches a target accuracy sooner at the same final accuracy; on the char-LM (2 AdamW steps)
    it costs 12% of loss, and on the tabular task (3 steps) it gains nothing.  The rule looks at task
    length only: over 2 epochs the char-LM (AdamW at 5e-3) also did worse with kept state at 8 and 16
    steps per task, at every worker count and at 1e-2 too, while digits did better with it at the same
    lengths.  Restarting AdamW speeds that model off its early loss plateau even in one process, and costs
    one worker past it (4 epochs); at 4 workers it still wins there.
    """
    if value != "auto":
        return value
    return "worker" if steps_per_task >= memory_steps(optimizer) - 1e-9 else "fresh"  # 1 / (1 - 0.9) > 10


def check_schedule(schedule: Any) -> Callable[[int, int], float] | None:
    """``lr_schedule`` checked on its first step.

    Raises
    ------
    TypeError
        Not a callable ``(epoch, step) -> factor`` or a :class:`~vcdask.lr_schedules.RunSchedule`: a torch
        scheduler (class or instance), or a callable that raises a ``TypeError`` when called as one (a
        one-argument ``lambda step: ...``); the message names ``lr_schedule`` and the expected signature.
    ValueError
        A negative or non-finite factor, or another error raised by the schedule's first call (named so).
    """
    if schedule is None:
        return None
    run = isinstance(schedule, RunSchedule)
    expected = (
        "lr_schedule must be a callable (epoch, step) -> factor or a vcdask.lr_schedules schedule"
        " (Cosine, Linear, Constant, OverRun(fn(step, total)))"
    )
    scheduler = torch.optim.lr_scheduler.LRScheduler
    if (isinstance(schedule, type) and issubclass(schedule, scheduler)) or isinstance(schedule, scheduler):
        what = schedule.__name__ if isinstance(schedule, type) else type(schedule).__name__
        raise TypeError(
            f"{expected}, got torch's {what}: a torch scheduler steps one optimizer in one process, and each shard "
            "task makes its own; use vcdask.lr_schedules.Cosine() for CosineAnnealingLR (or Linear, Constant(warmup=), "
            "OverRun(fn(step, total)) for LambdaLR's fn over the run's steps), or fn(epoch, step) -> factor"
        )
    if not callable(schedule):
        raise TypeError(f"{expected}, got {type(schedule).__name__}")
    call = "lr_schedule(0, total=1000)" if run else "lr_schedule(1, 0)"
    try:
        factor = schedule(0, 1000) if run else schedule(1, 0)
    except Exception as e:
        called = "schedule(step, total)" if run else "(epoch, step): epoch from 1, step the task's own from 0"
        error = TypeError if isinstance(e, TypeError) else ValueError
        raise error(f"{expected}; {call} raised {type(e).__name__}: {e} (it is called as {called})") from e
    if not is_real(factor) or not 0 <= float(factor) < float("inf"):
        raise ValueError(f"{call} must return a finite number >= 0, got {factor!r}")
    return schedule


class InnerOptimizer:
    """One shard task's optimizer: made fresh or taken from the worker's kept state; handed back after.

    Parameters
    ----------
    spec : RunSpec
    model : torch.nn.Module
        The model on its training device.
    precision : vcdask.device.Precision
        Its grad scaler (fp16) is kept with the optimizer state.
    epoch : int
        The run's epoch (for ``lr_schedule``).
    position : int, optional
        The task's shard's place in the order the run handed out its shards (0-based, over all
        epochs): where a :class:`~vcdask.lr_schedules.RunSchedule` puts the task's first step.
    """

    def __init__(self, spec, model: torch.nn.Module, precision, epoch: int, position: int | None = None):
        self.spec = spec
        self.precision = precision
        self.epoch = epoch
        self.start, self.total = 0, 1  # the task's first step on the run's global scale, and the run's steps
        if isinstance(spec.lr_schedule, RunSchedule):
            per_shard, self.total = run_steps(spec)
            if position is None:  # (a run dispatched before positions were sent: its epoch's start)
                position = (epoch - 1) * spec.shards.n_shards
            self.start = round(position * per_shard)
        self.optimizer: torch.optim.Optimizer = spec.optimizer(list(model.parameters()))  # (a list: one pass each)
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.step_count = 0
        self.resumed = False
        if spec.optimizer_state == "worker":
            with _lock:
                kept = _kept.get(spec.run_id)
                state = kept.pop() if kept else None
            if state is not None:
                self.optimizer.load_state_dict(state["optimizer"])
                if self.precision.scaler is not None and state.get("scaler"):
                    self.precision.scaler.load_state_dict(state["scaler"])
                self.resumed = True
        if self.precision.scaler is not None and not self.resumed:
            with _lock:
                scale = _scales.get(spec.run_id)
            if scale:
                self.precision.scaler.load_state_dict(scale)

    def step(self, loss: torch.Tensor) -> None:
        """Backward, clip, scheduled learning rate, optimizer step."""
        schedule = self.spec.lr_schedule
        if schedule is not None:
            if isinstance(schedule, RunSchedule):
                factor = float(schedule(self.start + self.step_count, self.total))
            else:
                factor = float(schedule(self.epoch, self.step_count))
            for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
                group["lr"] = base * factor
        self.optimizer.zero_grad(set_to_none=True)
        self.precision.step(loss, self.optimizer, self.spec.clip_grad_norm)
        self.step_count += 1

    def done(self, finite: bool = True) -> None:
        """The task trained to its end: keep the state for this worker's next task (``"worker"``).

        A task whose loss was not ``finite`` (or whose state holds NaN/inf) keeps nothing: its update
        will be rejected, and a poisoned state would spoil every later task on this worker.  The fp16 grad
        scaler's state is kept for the worker's next task of the run in either case.  The gradients go (the
        thread's model copy is kept for its next task: they held one more copy of the parameters till then)."""
        self.optimizer.zero_grad(set_to_none=True)
        if finite and self.precision.scaler is not None:
            with _lock:
                _scales.pop(self.spec.run_id, None)  # (the newest run last)
                _scales[self.spec.run_id] = self.precision.scaler.state_dict()
                for old in list(_scales)[:-_KEEP_RUNS]:
                    del _scales[old]
        if self.spec.optimizer_state != "worker":
            return
        if not (finite and _finite_state(self.optimizer)):
            return
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base
        state = {"optimizer": self.optimizer.state_dict()}
        if self.precision.scaler is not None:
            state["scaler"] = self.precision.scaler.state_dict()
        with _lock:
            _kept[self.spec.run_id] = _kept.pop(self.spec.run_id, [])  # (the run used last, last)
            _kept[self.spec.run_id].append(state)
            for old in list(_kept)[:-_KEEP_RUNS]:  # a long-lived cluster: forget runs long gone
                del _kept[old]


def forget(run_id: str) -> int:
    """Drop the optimizer states and the loss scale kept for run ``run_id`` (the run ended: the states may
    be on a GPU); how many optimizer states there were."""
    with _lock:
        _scales.pop(run_id, None)
        return len(_kept.pop(run_id, ()))


def _finite_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every floating tensor of the optimizer's state is finite: one device sync per device.

    The state may live on several devices (Adam keeps its ``step`` counters on the CPU and its moments
    beside the parameters, on CUDA), so the checks are combined per device, never across devices."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for state in optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(checks).all()) for checks in by_device.values())
