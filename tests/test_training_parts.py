"""The parts of local training without a cluster: devices and precision, batches, steps, the inner optimizer."""

from __future__ import annotations

import inspect
import threading
import types

import numpy as np
import pytest
import torch

import vcdask
from vcdask import batches, inner
from vcdask.device import Precision, check_device, check_precision, resolve_device, to
from vcdask.errors import DataError
from vcdask.steps import check_steps, evaluate


def test_check_device_and_precision():
    assert check_device("cuda:1") == "cuda:1" and check_device(torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match=r"device must be one of \['auto', 'cpu', 'cuda', 'cuda:N', 'mps'\].*'gpu'"):
        check_device("gpu")
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
    assert [n for _, n in got] == [2, 2, 1] and torch.equal(got[0][0][0], cols["X"][:2])


def test_cached_rows_are_the_rows_already_read_or_none():
    """A warm task takes its rows from the cache in one step (``cached_rows``), without reading."""
    reads = []
    src = types.SimpleNamespace(
        cache_key=("mem", id(test_cached_rows_are_the_rows_already_read_or_none)),
        url=None,
        read_columns=lambda a, b: reads.append((a, b)) or {"X": np.ones((b - a, 2)), "y": np.zeros(b - a)},
    )
    assert batches.cached_rows(src, 0, 4) is None and reads == []
    cols = batches.rows(_spec(), src, 0, 4)
    assert batches.cached_rows(src, 0, 4) is cols and reads == [(0, 4)]
    assert batches.cached_rows(src, 0, 4, pin=True) is None  # pinned rows are another entry
    assert batches.cached_rows(src, 4, 6) is None and reads == [(0, 4)]


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


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i % 2


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


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
