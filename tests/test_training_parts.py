"""The parts of local training without a cluster: devices and precision, batches, steps, the inner optimizer."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import types
from collections import OrderedDict

import numpy as np
import pytest
import torch

import vcdask
from vcdask import batches, inner
from vcdask.device import Precision, check_device, check_precision, cpu_copy, resolve_device, same_device, to
from vcdask.errors import DataError
from vcdask.steps import check_steps, evaluate


def test_check_device_and_precision():
    assert check_device("cuda:1") == "cuda:1" and check_device(torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match=r"device must be one of \['auto', 'cpu', 'cuda', 'cuda:N', 'mps'\].*'gpu'"):
        check_device("gpu")
    # a machine has one MPS device: torch.device("mps", 0) is "mps", mps:1 names none
    assert check_device(torch.device("mps", 0)) == "mps" and check_device("mps:0") == "mps"
    assert vcdask.Training(device=torch.device("mps", 0)).device == "mps"
    with pytest.raises(ValueError, match=r"device 'mps:1': a machine has one MPS device, 'mps' \(or 'mps:0'\)"):
        check_device(torch.device("mps", 1))
    assert check_device(torch.device("cpu", 0)) == "cpu" and check_device("cpu:0") == "cpu"
    with pytest.raises(ValueError, match=r"device 'cpu:1': a machine has one CPU device, 'cpu' \(or 'cpu:0'\)"):
        check_device("cpu:1")
    for bad in ("cuda:01", "cuda:-1", "cuda:"):  # (torch.device refuses "cuda:01": every task failed on it)
        with pytest.raises(ValueError, match=rf"got {bad!r}"):
            check_device(bad)
    assert check_device("cuda:10") == "cuda:10"
    assert check_precision("bf16-mixed") == "bf16" and check_precision(32) == "32"
    with pytest.raises(ValueError, match=r"precision must be one of \['32', 'bf16', '16-mixed'\], got 'fp8'"):
        check_precision("fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a worker without CUDA")
def test_explicit_cuda_on_a_worker_without_one_fails_the_task():
    assert resolve_device("auto") == torch.device("cpu") or resolve_device("auto").type == "mps"
    with pytest.raises(RuntimeError, match="this worker has no CUDA device"):
        resolve_device("cuda")


def _step_once(precision: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = Precision(precision, torch.device("cpu"))
    with p.autocast():
        out = model(torch.randn(16, 8))
        loss = torch.nn.functional.cross_entropy(out, torch.randint(0, 3, (16,)))
    p.step(loss, opt, clip_grad_norm=None)
    return model, before, out


@pytest.mark.parametrize(("precision", "dtype"), [("32", torch.float32), ("bf16", torch.bfloat16)])
def test_precision_autocasts_on_cpu(precision, dtype):
    model, before, out = _step_once(precision)
    assert out.dtype == dtype
    assert model.weight.dtype == torch.float32 and not torch.equal(model.weight, before)


def test_fp16_mixed_scales_gradients_on_cpu():
    model, before, out = _step_once("16-mixed")
    assert out.dtype == torch.float16 and not torch.equal(model.weight, before)


def test_gradient_clipping_bounds_the_step():
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = (model(torch.full((2, 4), 100.0)) - 1000.0).pow(2).mean()
    Precision("32", torch.device("cpu")).step(loss, opt, clip_grad_norm=0.5)
    assert float(model.weight.detach().norm()) == pytest.approx(0.5, rel=1e-5)


def test_to_moves_nested_batches_and_casts_only_floats():
    batch = {"a": torch.zeros(2, dtype=torch.float64), "b": (torch.arange(2), [torch.ones(1, dtype=torch.float64)])}
    moved = to(batch, torch.device("cpu"), torch.float32)
    assert moved["a"].dtype == torch.float32 and moved["b"][0].dtype == torch.int64
    assert moved["b"][1][0].dtype == torch.float32 and isinstance(moved["b"][1], list)


def test_prefetch_keeps_order_and_raises_where_the_item_failed():
    assert list(batches.prefetch(iter(range(50)), depth=3)) == list(range(50))

    def failing():
        yield 1
        raise KeyError("item 2 is broken")

    got = []
    with pytest.raises(KeyError, match="item 2 is broken"):
        for item in batches.prefetch(failing()):
            got.append(item)
    assert got == [1]


def test_prefetch_stopped_early_leaves_no_thread():
    def producers():  # (by name: other threads of this process, a scheduler's, may come and go meanwhile)
        return {t for t in threading.enumerate() if t.name == "vcdask-prefetch"}

    before = producers()
    for i in batches.prefetch(iter(range(1000)), depth=2):
        if i == 3:
            assert len(producers() - before) == 1
            break
    assert producers() <= before  # the producer has exited by the time the loop is left


def _spec(**kw):
    base = dict(
        run_id="r1",
        optimizer=lambda params: torch.optim.Adam(params, lr=0.1),
        optimizer_state="fresh",
        lr_schedule=None,
        clip_grad_norm=None,
        batch_form="xy",
        classification=True,
        x_dtype=torch.float32,
        cast_x=True,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


def _train_task(spec, model, epoch=1):
    opt = inner.InnerOptimizer(spec, model, Precision("32", torch.device("cpu")), epoch)
    for _ in range(3):
        opt.step(model(torch.ones(2, 3)).pow(2).mean())
    opt.done()
    return opt


def test_worker_optimizer_state_is_kept_per_run_and_fresh_by_default():
    model = torch.nn.Linear(3, 1)
    fresh = _spec()
    assert not _train_task(fresh, model).resumed and not _train_task(fresh, model).resumed
    kept = _spec(run_id="kept-run", optimizer_state="worker")
    first = _train_task(kept, model)
    second = inner.InnerOptimizer(kept, model, Precision("32", torch.device("cpu")), 1)
    assert not first.resumed and second.resumed
    state = second.optimizer.state_dict()["state"][0]
    assert int(state["step"]) == 3  # Adam's step count (and moments) carried over
    assert not inner.InnerOptimizer(_spec(run_id="other", optimizer_state="worker"), model, first.precision, 1).resumed


@pytest.mark.parametrize(
    ("make", "memory"),
    [
        (lambda p: torch.optim.Adam(p), 10.0),
        (lambda p: torch.optim.AdamW(p, betas=(0.8, 0.99)), 5.0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 10.0),
        (lambda p: torch.optim.SGD(p, lr=0.1), 1.0),
        (lambda p: torch.optim.Adagrad(p), 1.0),  # no first moment
    ],
)
def test_memory_steps_of_an_optimizer_is_what_its_first_moment_remembers(make, memory):
    assert inner.memory_steps(make(torch.nn.Linear(2, 1).parameters())) == pytest.approx(memory)


def test_an_optimizer_without_readable_groups_remembers_forever_so_auto_starts_fresh():
    odd = types.SimpleNamespace(param_groups=[{"betas": "not numbers"}])
    assert inner.memory_steps(odd) == float("inf")
    assert inner.memory_steps(types.SimpleNamespace()) == float("inf")
    assert inner.resolve_optimizer_state("auto", odd, 10_000) == "fresh"


def test_auto_optimizer_state_keeps_the_state_only_for_tasks_longer_than_the_first_moments_memory():
    adam = torch.optim.Adam(torch.nn.Linear(2, 1).parameters())
    assert inner.resolve_optimizer_state("auto", adam, 12) == "worker"
    assert inner.resolve_optimizer_state("auto", adam, 10) == "worker"
    assert inner.resolve_optimizer_state("auto", adam, 9) == "fresh"
    assert inner.resolve_optimizer_state("fresh", adam, 100) == "fresh"  # a choice is kept
    assert inner.resolve_optimizer_state("worker", adam, 1) == "worker"


@pytest.mark.parametrize(
    ("n_shards", "local_epochs", "expected"), [(4, 1, "worker"), (40, 1, "fresh"), (40, 5, "worker")]
)
def test_a_run_decides_auto_from_its_own_shards_and_local_epochs(tmp_path, n_shards, local_epochs, expected):
    """1438 digits rows: 4 shards of 359 rows are 12 steps of 32; 40 shards are 2 (10 with 5 local epochs)."""
    from vcdask.data import Shards
    from vcdask.demo import digits_cnn
    from vcdask.options import plan as plan_run
    from vcdask.runs import _optimizer_state

    X = np.zeros((1438, 1, 8, 8), "f4")
    y = np.arange(1438) % 10
    defaults = {
        k: p.default
        for k, p in inspect.signature(vcdask.fit).parameters.items()
        if p.default is not inspect.Parameter.empty and k in inspect.signature(plan_run).parameters
    }
    options = {**defaults, "store": tmp_path / "store", "training": vcdask.Training(local_epochs=local_epochs)}
    plan = plan_run(digits_cnn(), (X, y), **options)
    assert plan.training.optimizer_state == "auto"
    assert _optimizer_state(plan, Shards(1438, n_shards)) == expected


def test_a_task_that_diverged_keeps_no_optimizer_state():
    """A NaN loss, or NaN moments, would poison every later task on the worker: nothing is kept."""
    spec = _spec(run_id="diverged-run", optimizer_state="worker")
    model = torch.nn.Linear(3, 1)
    opt = inner.InnerOptimizer(spec, model, Precision("32", torch.device("cpu")), 1)
    opt.step(model(torch.ones(2, 3)).pow(2).mean())
    opt.done(finite=False)  # the task's loss was NaN
    assert not inner.InnerOptimizer(spec, model, opt.precision, 1).resumed
    opt = inner.InnerOptimizer(spec, model, opt.precision, 1)
    opt.step(model(torch.ones(2, 3)).pow(2).mean())
    opt.optimizer.state[model.weight]["exp_avg"].fill_(float("nan"))  # a finite loss, poisoned moments
    opt.done()
    assert not inner.InnerOptimizer(spec, model, opt.precision, 1).resumed
    _train_task(spec, model)  # a healthy task is kept
    assert inner.InnerOptimizer(spec, model, opt.precision, 1).resumed


def _on_two_devices(optimizer: torch.optim.Optimizer) -> None:
    """Lay Adam's state out as CUDA does: ``step`` on the CPU, the moments on the accelerator (a stand-in)."""
    from vcdask.testing.devices import on_accelerator

    for state in optimizer.state.values():
        for name in ("exp_avg", "exp_avg_sq"):
            state[name] = on_accelerator(state[name])


def test_optimizer_state_on_two_devices_is_checked_and_kept_as_on_a_gpu():
    """Every CUDA run with a kept state failed here (``torch.stack`` over tensors on two devices); the
    stand-in refuses the same mix on the CPU, so CI guards the GPU path."""
    from vcdask.testing.devices import ACCELERATOR

    spec = _spec(run_id="two-devices-run", optimizer_state="worker")
    model = torch.nn.Linear(3, 1)
    opt = inner.InnerOptimizer(spec, model, Precision("32", torch.device("cpu")), 1)
    opt.step(model(torch.ones(2, 3)).pow(2).mean())
    _on_two_devices(opt.optimizer)
    devices = {t.device for state in opt.optimizer.state.values() for t in state.values()}
    assert devices == {torch.device("cpu"), ACCELERATOR}
    with pytest.raises(RuntimeError, match="same device"):  # what the check did before
        torch.stack([torch.isfinite(t).all() for t in opt.optimizer.state[model.weight].values()])
    assert inner._finite_state(opt.optimizer)
    opt.done()
    assert inner.InnerOptimizer(spec, model, opt.precision, 1).resumed  # kept, and loaded by the next task

    opt = inner.InnerOptimizer(spec, model, opt.precision, 1)
    opt.step(model(torch.ones(2, 3)).pow(2).mean())
    _on_two_devices(opt.optimizer)
    opt.optimizer.state[model.bias]["exp_avg_sq"].fill_(float("inf"))  # poisoned on the accelerator
    assert not inner._finite_state(opt.optimizer)
    opt.done()
    assert not inner.InnerOptimizer(spec, model, opt.precision, 1).resumed


def _weights(loss):
    """The class weights a loss carries: a module's, or a partial's keyword."""
    return loss.weight if isinstance(loss, torch.nn.Module) else loss.keywords["weight"]


@pytest.mark.parametrize(
    "make_loss",
    [
        lambda w: torch.nn.CrossEntropyLoss(weight=w),
        lambda w: functools.partial(torch.nn.functional.cross_entropy, weight=w),  # (failed every task still)
    ],
    ids=["module", "partial"],
)
def test_the_tensors_of_a_loss_go_to_the_workers_device_once_a_run(monkeypatch, make_loss):
    """``CrossEntropyLoss(weight=...)``'s class weights (or ``partial(F.cross_entropy, weight=...)``'s) stayed on
    the CPU while the outputs and labels were on the GPU: every task of a CUDA worker failed.  The stand-in refuses
    the same mix; the loss the default step gets on the device is a copy there (made once per run and device), and
    the spec's stays on the CPU for validation."""
    from vcdask import _held
    from vcdask.steps import SupervisedStep
    from vcdask.testing.devices import ACCELERATOR, OnAccelerator, on_accelerator

    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):  # a move to the stand-in device (Module.to moves each tensor this way)
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, torch.device) and target.type == "cuda":
            return self if isinstance(self, OnAccelerator) else on_accelerator(self.clone())
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    loss = make_loss(torch.tensor([1.0, 5.0, 1.0]))
    spec = _spec(run_id="loss-on-device", loss=loss)
    logits = on_accelerator(torch.randn(4, 3, requires_grad=True))  # the model's outputs on the worker's GPU
    batch = (None, on_accelerator(torch.tensor([0, 1, 2, 1])))  # the batch, moved there by vcdask

    class Outputs(torch.nn.Module):
        def forward(self, _x):
            return logits

    with pytest.raises(RuntimeError, match="same device"):  # what the workers' step did
        SupervisedStep(spec.loss)(Outputs(), batch)
    on_gpu = _held.loss_on(spec, ACCELERATOR)
    expected = torch.nn.functional.cross_entropy(logits.cpu(), batch[1].cpu(), weight=_weights(loss))
    assert torch.allclose(SupervisedStep(on_gpu)(Outputs(), batch).cpu(), expected)
    assert _weights(on_gpu).device == ACCELERATOR and _weights(loss).device.type == "cpu"
    assert _held.loss_on(spec, ACCELERATOR) is on_gpu  # once a run and device
    assert _held.loss_on(spec, torch.device("cpu")) is loss  # already there: the spec's own
    plain = _spec(loss=torch.nn.functional.cross_entropy)
    assert _held.loss_on(plain, ACCELERATOR) is torch.nn.functional.cross_entropy
    assert asyncio.run(_held.release_run("loss-on-device"))["losses"] == 1


@pytest.mark.parametrize(
    "make_loss",
    [
        lambda w: torch.nn.CrossEntropyLoss(weight=w),
        lambda w: functools.partial(torch.nn.functional.cross_entropy, weight=w),
        lambda w: functools.partial(torch.nn.CrossEntropyLoss(weight=w)),  # (a partial of a module: both moved)
    ],
    ids=["module", "partial", "partial-of-module"],
)
def test_a_loss_with_tensors_on_the_gpu_is_planned_on_the_cpu(make_loss, tmp_path):
    """``fit(model.cuda(), data, loss=partial(F.cross_entropy, weight=w.cuda()))``: the run's loss is a CPU copy,
    as a loss module's was (a partial stayed on the GPU: the check of the model on a few rows, on the CPU,
    refused the run, 'the loss cannot compare model outputs of shape (4, 2) with labels of shape (4,)')."""
    from vcdask.options import plan
    from vcdask.testing.devices import ACCELERATOR, on_accelerator

    loss = make_loss(on_accelerator(torch.tensor([1.0, 2.0])))
    X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    planned = plan(torch.nn.Linear(4, 2), (X, (X[:, 0] > 0).astype("int64")), loss=loss, store=tmp_path / "s")
    from vcdask.device import loss_tensors

    assert [t.device.type for t in loss_tensors(planned.loss)] == ["cpu"]
    assert [t.device for t in loss_tensors(loss)] == [ACCELERATOR]  # (the caller's left where it is)


def test_a_cpu_copy_of_a_gpu_model_is_made_on_the_cpu():
    """``cpu_copy`` (the client's checks and the run's staged model): every tensor on the CPU, equal to the
    model's, its own memory; parameters stay parameters (a frozen one frozen), tied ones tied; the model
    itself stays on its device."""
    from vcdask.testing.devices import ACCELERATOR, on_accelerator

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    model[2].bias = model[0].bias  # tied
    model[0].weight.requires_grad_(False)  # frozen
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(on_accelerator(p.detach().clone()), p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, on_accelerator(b))
    model[2].bias = model[0].bias
    copy_ = cpu_copy(model)
    for (name, t), c in zip(model.state_dict().items(), copy_.state_dict().values(), strict=True):
        assert t.device == ACCELERATOR and type(c) is torch.Tensor and c.device.type == "cpu", name
        assert torch.equal(t.cpu(), c) and c.data_ptr() != t.data_ptr(), name
    assert all(isinstance(p, torch.nn.Parameter) for p in copy_.parameters())
    assert not copy_[0].weight.requires_grad and copy_[0].bias.requires_grad
    assert copy_[2].bias is copy_[0].bias
    assert copy_.train()(torch.ones(2, 3)).shape == (2, 4)  # takes CPU batches


def test_a_process_that_trains_on_its_cpu_pins_nothing_where_it_sees_a_gpu(monkeypatch):
    """Pinning creates a CUDA context (hundreds of MB of the GPU's memory a process): a worker that trains on
    its CPU (``device="cpu"``, or a CPU run on a GPU machine) keeps its versions in pageable memory; a worker
    that trained on CUDA pins them, so copies to its GPU do not block."""
    from collections import OrderedDict

    from vcdask import _held
    from vcdask._wire import pack
    from vcdask.params import flatten

    pinned = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU machine says
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *_a, **_k: pinned.append(self) or self)
    monkeypatch.setattr(_held, "_versions", OrderedDict())
    monkeypatch.setattr(_held, "_trained_on", set(), raising=False)  # a process that has not trained yet
    device, _ = _held.setup(types.SimpleNamespace(torch_threads=torch.get_num_threads(), device="cpu", precision="32"))
    params = flatten(torch.nn.Linear(3, 1))
    _held.keep_version("v1", params)
    _held.brought(None, pack(params))  # a draft
    _held.brought("v2", pack(params))
    assert device.type == "cpu" and pinned == []
    _held._trained_on.add(torch.device("cuda", 0))  # as setup leaves a process that trained on CUDA
    _held.keep_version("v3", params)
    assert len(pinned) == len(params.arrays)


def test_a_worker_keeps_fewer_versions_of_a_large_model(monkeypatch):
    """A worker kept its 4 newest versions whatever their size (4 copies of a 264 MB model besides the one it
    trains: tasks rarely read an older one again); it keeps 4 at most within its byte budget, and 2 at least."""
    from vcdask import _held
    from vcdask.params import flatten

    monkeypatch.setattr(_held, "_versions", OrderedDict())
    params = flatten(torch.nn.Linear(100, 10))  # 4,040 bytes
    for i in range(6):
        _held.keep_version(f"small{i}", params)
    assert list(_held._versions) == ["small2", "small3", "small4", "small5"]
    monkeypatch.setattr(_held, "_VERSIONS_BYTES", 3 * params.nbytes)
    _held.keep_version("v6", params)
    assert list(_held._versions) == ["small4", "small5", "v6"]
    monkeypatch.setattr(_held, "_VERSIONS_BYTES", params.nbytes // 2)
    _held.keep_version("v7", params)
    assert list(_held._versions) == ["v6", "v7"]


def test_the_scheduler_keeps_the_bases_of_compressed_updates_within_its_byte_budget(monkeypatch):
    from vcdask.engine import committing

    bases = OrderedDict((f"v{i}", None) for i in range(10))
    committing.trim_bases(bases, 1 << 20)
    assert list(bases) == [f"v{i}" for i in range(2, 10)]  # (BASES_KEPT of a small model)
    committing.trim_bases(bases, 256 << 20)  # (a 67M-parameter model: 4 of them in 1 GiB)
    assert list(bases) == ["v6", "v7", "v8", "v9"]
    committing.trim_bases(bases, 2 << 30)
    assert list(bases) == ["v8", "v9"]


def test_a_tasks_gradients_go_when_it_ends():
    """The thread's model copy is kept for its next task; its gradients were too (one more copy of the
    parameters on every worker thread between tasks)."""
    spec = types.SimpleNamespace(
        run_id="r-grads", optimizer=torch.optim.SGD, optimizer_state="fresh", lr_schedule=None, clip_grad_norm=None
    )
    model = torch.nn.Linear(4, 2)
    opt = inner.InnerOptimizer(spec, model, Precision("32", torch.device("cpu")), 1)
    opt.step(model(torch.ones(3, 4)).sum())
    assert model.weight.grad is not None
    opt.done()
    assert model.weight.grad is None and model.bias.grad is None


def test_a_gpu_shard_is_copied_once_a_task_and_cut_there_without_a_copy_per_batch(monkeypatch):
    """On a GPU a shard that fits is copied once a task (not once a local epoch) and its batches are cut on
    the device from one copy of the epoch's order.  A copy from pageable memory waits for the device's queue,
    so one copy of each batch's indices stopped the next step from being queued while the last ran."""
    from vcdask.testing.devices import ACCELERATOR, OnAccelerator, on_accelerator

    copies = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):  # a copy to the stand-in device, counted
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, torch.device) and target.type == "cuda":
            if isinstance(self, OnAccelerator):
                return self  # (already there: no copy)
            copies.append(tuple(self.shape))
            return on_accelerator(self.clone())
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    spec = types.SimpleNamespace(batch_form="xy", x_dtype=torch.float32)
    rows = {"X": torch.randn(10, 3), "y": torch.arange(10)}
    on_cpu = list(batches.batches(spec, rows, torch.device("cpu"), 3, generator=torch.Generator().manual_seed(1)))
    assert copies == []
    on_gpu = list(batches.batches(spec, rows, ACCELERATOR, 3, generator=torch.Generator().manual_seed(1)))
    assert sorted(copies) == [(10,), (10,), (10, 3)]  # the shard's two columns and the order, once each
    assert [n for _, n in on_gpu] == [n for _, n in on_cpu] == [3, 3, 2, 2]  # (no lone last row)
    for (gpu, _), (cpu, _) in zip(on_gpu, on_cpu, strict=True):
        assert all(t.device == ACCELERATOR for t in gpu)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(gpu, cpu, strict=True))
    copies.clear()
    task_rows = batches.on_device(rows, ACCELERATOR)  # what a task does before its local epochs
    for epoch in range(3):
        list(batches.batches(spec, task_rows, ACCELERATOR, 3, generator=torch.Generator().manual_seed(epoch)))
    assert sorted(copies) == [(10,)] * 4 + [(10, 3)]  # the columns once, an order per local epoch
    assert batches.on_device(rows, torch.device("cpu")) is rows


@pytest.mark.parametrize("optimizer_state", ["fresh", "worker"])
def test_a_task_in_fp16_starts_from_the_loss_scale_its_workers_last_task_found(optimizer_state):
    """A loss scale is the model's, not the optimizer's: a fresh task started from torch's 65536 again and
    skipped its first steps to overflows (on a model whose gradients overflow there, every step of a short
    task: an update equal to its base).  A task that diverged leaves nothing; another run starts afresh."""
    spec = _spec(run_id=f"fp16-{optimizer_state}", optimizer_state=optimizer_state)

    def task(spec, finite=True):
        model = torch.nn.Linear(3, 1)
        opt = inner.InnerOptimizer(spec, model, Precision("16-mixed", torch.device("cpu")), 1)
        start = opt.precision.scaler.get_scale()
        for _ in range(3):  # gradients of 1e36: every step at a scale over ~340 overflows and halves it
            opt.step(model(torch.ones(2, 3)).sum() * 1e36)
        opt.done(finite=finite)
        return start, opt.precision.scaler.get_scale()

    start, end = task(spec)
    assert (start, end) == (65536.0, 8192.0)
    assert task(spec) == (8192.0, 1024.0)  # the next task goes on from there
    assert task(spec, finite=False)[0] == 1024.0
    assert task(spec)[0] == 1024.0  # (not from the one that diverged)
    assert task(_spec(run_id=f"another-{optimizer_state}", optimizer_state=optimizer_state))[0] == 65536.0


def test_same_device_takes_an_index_left_out_as_the_current_one(monkeypatch):
    """``predict(device="cuda")`` of a model on ``cuda:0`` runs the model itself, not a copy on the same GPU."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    d = torch.device
    assert same_device(d("cuda"), d("cuda:1")) and same_device(d("cuda:1"), d("cuda"))
    assert not same_device(d("cuda"), d("cuda:0")) and not same_device(d("cuda:0"), d("cpu"))
    assert same_device(d("mps"), d("mps:0")) and same_device(d("cpu"), d("cpu"))
    assert not same_device(d("mps"), d("cpu"))


def test_releasing_a_run_drops_what_every_thread_keeps_for_it_and_nothing_of_another_run():
    """``release_run`` (each worker, when a run ends): every thread's model copies of the run, its
    hand-overs and optimizer states go; another run's stay."""
    import concurrent.futures

    from vcdask import _held, overlap
    from vcdask.params import flatten

    def keep(run_id):
        spec = _spec(run_id=run_id, optimizer_state="worker", model=torch.nn.Linear(3, 1))
        _held._model(spec, torch.device("cpu"))
        _train_task(spec, torch.nn.Linear(3, 1))
        overlap.put(overlap.Pending(run_id, concurrent.futures.Future(), flatten(spec.model)))

    kept, done = threading.Barrier(3), threading.Event()

    def worker_thread():  # a worker thread that trained both runs, alive while the run ends
        keep("release-a")
        keep("release-b")
        kept.wait()
        done.wait(30)

    threads = [threading.Thread(target=worker_thread) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        kept.wait(30)
        keep("release-a")  # and this thread
        dropped = asyncio.run(_held.release_run("release-a"))  # (a task takes the state one before kept: 1 to 3)
        assert dropped["models"] == dropped["hand_overs"] == 3 and dropped["optimizer_states"] >= 1, dropped
        assert not any(asyncio.run(_held.release_run("release-a")).values())
        assert asyncio.run(_held.release_run("release-b"))["models"] == 2
    finally:
        done.set()
        for t in threads:
            t.join()


def test_the_accelerator_stand_in_refuses_what_cuda_refuses():
    from vcdask.testing.devices import on_accelerator

    a, cpu = on_accelerator(torch.ones(3)), torch.ones(3)
    for combine in (lambda: a + cpu, lambda: torch.stack([a, cpu]), lambda: torch.cat([cpu, a])):
        with pytest.raises(RuntimeError, match="same device"):
            combine()
    assert torch.equal((a * torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))  # a 0-d CPU tensor is a scalar
    with pytest.raises(RuntimeError, match="same device"):
        torch.stack([on_accelerator(torch.tensor(True)), torch.tensor(True)])  # but not in a list
    moved = a.to("cpu")
    assert type(moved) is torch.Tensor and torch.equal(moved + cpu, torch.full((3,), 2.0))
    assert moved.data_ptr() != a.data_ptr()  # a copy of its own, as from a device
    with pytest.raises(TypeError, match="to numpy"):
        a.numpy()
    assert a.cpu().numpy().tolist() == [1.0, 1.0, 1.0]


def test_lr_schedule_scales_each_local_step():
    model = torch.nn.Linear(3, 1)
    seen = []
    spec = _spec(lr_schedule=lambda epoch, step: seen.append((epoch, step)) or 0.5**step)
    opt = _train_task(spec, model, epoch=4)
    assert seen == [(4, 0), (4, 1), (4, 2)]
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)
    with pytest.raises(ValueError, match="lr_schedule"):
        inner.check_schedule(lambda _epoch, _step: -1)


def test_integer_inputs_stay_integer_without_cast():
    src = types.SimpleNamespace(
        cache_key=("mem", id(test_integer_inputs_stay_integer_without_cast)),
        url=None,
        read_columns=lambda a, b: {"X": np.arange(12).reshape(6, 2)[a:b], "y": np.arange(6)[a:b]},
    )
    cols = batches.rows(_spec(cast_x=False), src, 0, 6)
    assert cols["X"].dtype == torch.int64 and cols["y"].dtype == torch.int64
    cols = batches.rows(_spec(cast_x=True), src, 1, 6)
    assert cols["X"].dtype == torch.float32
    got = list(batches.batches(_spec(), cols, torch.device("cpu"), 2))
    assert [n for _, n in got] == [2, 3] and torch.equal(got[0][0][0], cols["X"][:2])


def _stand_in_copies(monkeypatch) -> None:
    """Copies to a CUDA device made to the accelerator stand-in (as the GPU shard test does)."""
    from vcdask.testing.devices import OnAccelerator, on_accelerator

    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, torch.device) and target.type == "cuda":
            return self if isinstance(self, OnAccelerator) else on_accelerator(self.clone())
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)


class _Rows(torch.utils.data.Dataset):
    """Item ``i`` is ``([i], i % 2)``: a batch names the rows it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i % 2


@pytest.mark.parametrize("path", ["cpu", "gpu", "gpu-prefetched", "dataset"])
@pytest.mark.parametrize(
    ("n", "batch_size", "sizes"),
    [
        (13, 4, [4, 4, 3, 2]),  # a remainder of 1: the batch before gives the last one a row
        (129, 32, [32, 32, 32, 31, 2]),  # (a shard of the reviewer's run at the default batch_size)
        (12, 4, [4, 4, 4]),  # no remainder
        (14, 4, [4, 4, 4, 2]),  # a remainder of 2 or more is a batch as it is
        (5, 4, [3, 2]),  # the shard's one full batch gives the row
        (7, 2, [2, 2, 3]),  # batch_size=2 has none to give: the row joins the batch before
        (1, 4, [1]),  # a shard of one row stays one batch of it
        (3, 1, [1, 1, 1]),  # so do batches of one, asked for
    ],
)
def test_a_shard_never_trains_a_lone_last_row_and_every_row_once(monkeypatch, path, n, batch_size, sizes):
    """A lone last row was a batch of its own: a model with BatchNorm failed every try of that shard's task
    ("Expected more than 1 value per channel when training"), on every way a worker cuts its batches."""
    from vcdask.data import prepare_data
    from vcdask.testing.devices import ACCELERATOR

    _stand_in_copies(monkeypatch)
    if path == "gpu-prefetched":  # a shard too large to copy whole: cut on the CPU, each batch copied
        monkeypatch.setattr(batches, "_ON_DEVICE_BYTES", 0)
    if path == "dataset":
        prepared = prepare_data(_Rows(n))
        spec = _spec(batch_form=prepared.form)
        rows = batches.rows(spec, prepared.source, 0, n)
    else:
        spec = _spec()
        rows = {"X": torch.arange(n, dtype=torch.float32)[:, None], "y": torch.arange(n) % 2}
    device = torch.device("cpu") if path in ("cpu", "dataset") else ACCELERATOR
    got = list(batches.batches(spec, rows, device, batch_size, generator=torch.Generator().manual_seed(3)))
    assert [k for _, k in got] == [len(x) for (x, _y), _ in got] == sizes
    assert sorted(int(v) for (x, _y), _ in got for v in x.cpu().flatten()) == list(range(n))
    assert [(i, j) for i, j in batches.batch_bounds(n, batch_size)] == [
        (sum(sizes[:k]), sum(sizes[: k + 1])) for k in range(len(sizes))
    ]
    if batch_size != 2:  # the steps a shard takes, as the run counts them for its schedule and record
        assert len(got) == -(-n // batch_size)


def test_a_speed_adapted_share_of_a_shard_is_its_first_batches_without_a_lone_row():
    """``limit`` takes the first batches of the shard's own cut (a share of all of them ends as the whole)."""
    rows = {"X": torch.arange(13, dtype=torch.float32)[:, None], "y": torch.zeros(13, dtype=torch.int64)}

    def sizes(limit):
        g = torch.Generator().manual_seed(0)
        return [k for _, k in batches.batches(_spec(), rows, torch.device("cpu"), 4, generator=g, limit=limit)]

    assert sizes(None) == sizes(4) == [4, 4, 3, 2]
    assert sizes(3) == [4, 4, 3] and sizes(1) == [4]


def test_a_batchnorm_model_trains_every_shard_of_a_run_and_the_schedule_counts_its_steps():
    """The reviewer's run: 288 rows, 10% held out, the default batch_size over two shards left one of 129 rows
    (4 x 32 + 1), whose task failed on every try in train mode; the pre-flight probe runs in eval mode and
    passed.  Each shard's batches now train, in the number of steps the learning-rate schedule counts."""
    from vcdask.data import Shards
    from vcdask.lr_schedules import run_steps
    from vcdask.options import resolve_loss
    from vcdask.steps import SupervisedStep

    rng = np.random.default_rng(0)
    X = rng.normal(size=(259, 4)).astype("float32")
    y = (X[:, 0] > 0).astype("int64")
    src = types.SimpleNamespace(
        cache_key=("mem", id(test_a_batchnorm_model_trains_every_shard_of_a_run_and_the_schedule_counts_its_steps)),
        url=None,
        read_columns=lambda a, b: {"X": X[a:b], "y": y[a:b]},
    )
    shards = Shards(259, 2)
    spec = _spec(run_id="batchnorm-run", shards=shards, batch_size=32, local_epochs=2, max_epochs=3)
    assert [b - a for a, b in map(shards.bounds, range(2))] == [130, 129]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    ).train()
    step = SupervisedStep(resolve_loss(None, True))
    taken = 0
    try:
        for shard in range(2):
            rows = batches.rows(spec, src, *shards.bounds(shard))
            g = torch.Generator().manual_seed(shard)
            for _ in range(spec.local_epochs):
                for batch, _n in batches.batches(spec, rows, torch.device("cpu"), spec.batch_size, generator=g):
                    step(model, batch).backward()
                    taken += 1
    finally:
        batches.forget(spec.run_id)
    assert taken * spec.max_epochs == run_steps(spec)[1] == 3 * 2 * (5 + 5)


def test_cached_rows_are_the_rows_already_read_or_none():
    """A warm task takes its rows from the cache in one step (``cached_rows``), without reading."""
    reads = []
    src = types.SimpleNamespace(
        cache_key=("mem", id(test_cached_rows_are_the_rows_already_read_or_none)),
        url=None,
        read_columns=lambda a, b: reads.append((a, b)) or {"X": np.ones((b - a, 2)), "y": np.zeros(b - a)},
    )
    spec = _spec()
    assert batches.cached_rows(spec, src, 0, 4) is None and reads == []
    cols = batches.rows(spec, src, 0, 4)
    assert batches.cached_rows(spec, src, 0, 4) is cols and reads == [(0, 4)]
    assert batches.cached_rows(spec, src, 0, 4, pin=True) is None  # pinned rows are another entry
    assert batches.cached_rows(spec, src, 4, 6) is None and reads == [(0, 4)]


def test_rows_cached_for_one_run_are_not_given_to_a_run_that_casts_them_otherwise():
    """Rows are kept as the run trains on them: another run over the same data (read where it lives, so
    the same cache key) with a model of another dtype, or a regression where the first classified,
    reads its own."""
    src = types.SimpleNamespace(
        cache_key=("mem", id(test_rows_cached_for_one_run_are_not_given_to_a_run_that_casts_them_otherwise)),
        url=None,
        read_columns=lambda a, b: {"X": np.ones((b - a, 2)), "y": np.arange(b - a)},
    )
    classifier = batches.rows(_spec(run_id="classifier"), src, 0, 4)
    regression = _spec(run_id="regression", classification=False, x_dtype=torch.float64)
    cols = batches.rows(regression, src, 0, 4)
    assert (classifier["X"].dtype, classifier["y"].dtype) == (torch.float32, torch.int64)
    assert (cols["X"].dtype, cols["y"].dtype) == (torch.float64, torch.float64)
    assert batches.cached_rows(_spec(run_id="classifier"), src, 0, 4) is classifier


def test_rows_rewritten_where_they_live_between_two_runs_are_read_again_and_a_run_lets_go_of_its_own():
    """Data read where it lives (a Zarr path) may be fixed in place between two fits on one cluster: the
    next run reads it again, not the rows a worker kept for the last one; a run's end drops its rows."""
    data = {"y": np.zeros(6)}
    src = types.SimpleNamespace(
        cache_key=("mem", "rewritten"),
        url=None,
        read_columns=lambda a, b: {"X": np.ones((b - a, 2)), "y": data["y"][a:b]},
    )
    assert batches.rows(_spec(run_id="first"), src, 0, 6)["y"].tolist() == [0] * 6
    data["y"] = np.ones(6)  # rewritten in place
    assert batches.rows(_spec(run_id="second"), src, 0, 6)["y"].tolist() == [1] * 6
    assert batches.forget("first") == 1 and batches.cached_rows(_spec(run_id="first"), src, 0, 6) is None
    assert batches.cached_rows(_spec(run_id="second"), src, 0, 6) is not None
    batches.forget("second")


def test_check_steps_names_what_is_wrong():
    model = torch.nn.Linear(2, 1)
    batch = (torch.ones(3, 2), torch.ones(3, 1))
    ok = check_steps(model, batch, lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), lambda _m, _b: {"mse": 0.5, "n": 3})
    assert ok == ["mse", "n"]
    with pytest.raises(DataError, match=r"scalar loss tensor, got a tensor of shape \(3, 1\)"):
        check_steps(model, batch, lambda m, b: m(b[0]), None)
    with pytest.raises(DataError, match="train_step fails on a batch.*TypeError: tuple indices"):
        check_steps(model, batch, lambda m, b: m(b["x"]), None)
    with pytest.raises(TypeError, match="eval_step must return a non-empty dict"):
        check_steps(model, batch, lambda m, b: m(b[0]).sum(), lambda _m, _b: [1.0])


def test_evaluate_weights_eval_step_values_by_batch_size():
    spec = types.SimpleNamespace(train_step=lambda _m, _b: None, eval_step=lambda _m, b: {"v": b.float().mean()})
    parts = [(torch.tensor([1.0, 1.0, 1.0]), 3), (torch.tensor([5.0]), 1)]
    got = evaluate(spec, torch.nn.Identity(), parts, Precision("32", torch.device("cpu")))
    assert got == {"v": pytest.approx((3 * 1.0 + 5.0) / 4)}


@pytest.mark.parametrize("precision", ["bf16", "16-mixed"])
def test_validation_computes_the_loss_and_metrics_in_float32_under_any_precision(precision):
    """The default step's forward passes run under the run's autocast; its loss and metrics, on the CPU, in float32
    (on a CPU worker they ran under CPU autocast: a metric with a matmul came out in bf16 / fp16, so one version
    validated other numbers on a CPU worker than on a GPU one)."""
    torch.manual_seed(0)
    model, W = torch.nn.Linear(8, 4), torch.randn(4, 4)

    def energy(out, y):
        return ((out @ W) ** 2).mean()

    spec = types.SimpleNamespace(
        train_step=None, loss=torch.nn.functional.cross_entropy, metrics={"energy": energy}, batch_form="xy"
    )
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    got = evaluate(spec, model, [((x, y), 64)], Precision(precision, torch.device("cpu")))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16):
            out = model(x).float()
        expected = energy(out, y)
    assert got["energy"] == pytest.approx(float(expected), rel=1e-6)
    assert got["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(out, y)), rel=1e-6)


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i % 2


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


class _Typed(torch.utils.data.Dataset):
    """Items of a dtype NumPy lacks (bfloat16), or on a GPU (the accelerator stand-in)."""

    def __init__(self, kind):
        self.kind = kind

    def __len__(self):
        return 8

    def __getitem__(self, i):
        x, y = torch.full((2,), float(i)), torch.tensor(float(i % 2))
        if self.kind == "bf16":
            return x.to(torch.bfloat16), y.to(torch.bfloat16)
        from vcdask.testing.devices import on_accelerator

        return on_accelerator(x), on_accelerator(y)


@pytest.mark.parametrize("kind", ["bf16", "gpu"])
def test_a_datasets_probe_batch_of_bf16_or_gpu_items_is_described_from_the_cpu(kind):
    """The probe batch's arrays come from the CPU, in float32 where NumPy has no dtype (they once ended in
    NumPy's raw ``TypeError``)."""
    from vcdask.torch_data import prepare_dataset

    prepared = prepare_dataset(_Typed(kind))
    assert prepared.sample_X.dtype == prepared.sample_y.dtype == prepared.y_dtype == np.float32
    assert prepared.sample_X.tolist() == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert prepared.x_shape == (2,) and prepared.sample_y.tolist() == [0.0, 1.0, 0.0, 1.0]


class _Labelled(torch.utils.data.Dataset):
    """Items whose labels are int32 or bool tensors (a dataset's own choice of dtype)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((5,), float(i)), torch.tensor(i % 2, dtype=self.dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_a_datasets_int32_or_bool_labels_reach_the_loss_as_class_ids(dtype):
    """The pre-run check casts a dataset's labels to int64; the workers' batches must too (cross-entropy
    refuses int32 and bool targets: every step of the run failed, after the check had passed)."""
    from vcdask.data import prepare_data
    from vcdask.options import resolve_loss
    from vcdask.steps import SupervisedStep

    prepared = prepare_data(_Labelled(dtype))
    spec = _spec(batch_form=prepared.form, classification=prepared.classification)
    assert spec.classification
    rows = batches.rows(spec, prepared.source, 0, 12)
    model = torch.nn.Linear(5, 2)
    for batch, _ in batches.batches(spec, rows, torch.device("cpu"), 4, generator=torch.Generator().manual_seed(0)):
        assert batch[1].dtype == torch.int64 and set(batch[1].tolist()) <= {0, 1}
        SupervisedStep(resolve_loss(None, True))(model, batch).backward()


@pytest.mark.parametrize(
    ("data", "kwargs", "error", "match"),
    [
        ((np.ones((8, 2), "f4"), np.zeros(8, int)), {"device": "gpu"}, ValueError, r"device must be one of"),
        ((np.ones((8, 2), "f4"), np.zeros(8, int)), {"precision": "fp8"}, ValueError, r"precision must be one of"),
        (
            (np.ones((8, 2), "f4"), np.zeros(8, int)),
            {"optimizer_state": "kept"},
            ValueError,
            r"\['auto', 'fresh', 'worker'\]",
        ),
        ((np.ones((8, 2), "f4"), np.zeros(8, int)), {"eval_step": lambda _m, _b: {}}, TypeError, "eval_step needs"),
        ((np.ones((8, 2), "f4"), np.zeros(8, int)), {"clip_grad_norm": 0}, ValueError, "clip_grad_norm must be"),
        ({"a": np.ones((8, 2), "f4"), "b": np.ones(8)}, {}, TypeError, "dict data gives dict batches"),
        ({"a": np.ones((8, 2), "f4"), "b": np.ones(7)}, {"train_step": len}, DataError, "equal lengths"),
        (_Stream(), {}, TypeError, "iterable-style dataset"),
        (_Squares(), {"train_step": lambda m, b: m(b[0]).sum(), "metrics": ["accuracy"]}, TypeError, "metrics="),
    ],
)
def test_bad_training_options_fail_before_cluster_work(tmp_path, data, kwargs, error, match):
    with pytest.raises(error, match=match):
        vcdask.fit(torch.nn.Linear(2, 2), data, store=str(tmp_path / "s"), progress=False, **kwargs)
    assert not (tmp_path / "s").exists()


def test_auto_is_each_worker_threads_own_gpu_whatever_a_run_before_set(monkeypatch):
    """CUDA's current device is per thread, and Dask's worker threads outlive tasks: a run on ``cuda:1``
    left it current, and the next run's ``device="auto"`` trained there (under dask-cuda, on another
    worker's GPU).  A stand-in for CUDA's per-thread current device (CI has no GPU)."""
    import concurrent.futures
    import threading

    from vcdask import _held

    current = threading.local()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "index", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(current, "index", torch.device(d).index))
    # (setup records the devices it trained on: left as cuda:0 and cuda:1, a later test's release of a run in
    # this process asked a CPU-only torch for their caches, "Cannot access accelerator device")
    monkeypatch.setattr(_held, "_trained_on", set())

    threads = torch.get_num_threads()  # (setup sets the process's: left as it is)

    def tasks():
        first = _held.setup(_spec(run_id="a", device="cuda:1", torch_threads=threads, precision="32"))[0]
        auto = _held.setup(_spec(run_id="b", device="auto", torch_threads=threads, precision="32"))[0]
        _held.setup(_spec(run_id="c", device="cuda:1", torch_threads=threads, precision="32"))
        cuda = _held.setup(_spec(run_id="d", device="cuda", torch_threads=threads, precision="32"))[0]
        return first, (auto, cuda), torch.cuda.current_device()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a fresh thread: a worker's
        first, auto, now = pool.submit(tasks).result()
    assert first == torch.device("cuda", 1)
    assert auto == (torch.device("cuda", 0),) * 2 and now == 0  # its own ("cuda" too), current for the task
