"""Learning-rate schedules over the run's global count of local steps (vcdask.lr_schedules, vcdask.inner)."""

from __future__ import annotations

import math
import pickle
import types

import pytest
import torch

from vcdask import inner, lr_schedules
from vcdask.data import Shards
from vcdask.device import Precision
from vcdask.lr_schedules import Constant, Cosine, Linear, OverRun, run_steps


def test_cosine_linear_and_constant_over_the_run():
    total = 100
    cos = Cosine()
    assert cos(0, total) == 1.0 and cos(50, total) == pytest.approx(0.5) and cos(100, total) == pytest.approx(0.0)
    assert Cosine(final=0.1)(100, total) == pytest.approx(0.1)
    warm = Cosine(warmup=0.1)
    assert [warm(s, total) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # 10 steps up to 1
    assert warm(10, total) == pytest.approx(1.0) and warm(55, total) == pytest.approx(0.5)
    assert Linear()(25, total) == pytest.approx(0.75) and Linear(final=0.5)(100, total) == pytest.approx(0.5)
    assert Constant(warmup=0.5)(0, 10) == pytest.approx(0.2) and Constant()(7, 10) == 1.0
    assert OverRun(lambda step, n: step / n)(3, 4) == 0.75
    assert all(0.0 <= warm(s, total) <= 1.0 for s in range(total + 5))  # past the end: held at final


def test_bad_schedules_are_refused_with_the_value():
    with pytest.raises(ValueError, match=r"warmup must be a number in \[0, 1\), got 1.5"):
        Cosine(warmup=1.5)
    with pytest.raises(ValueError, match="final .* got -0.1"):
        Linear(final=-0.1)
    with pytest.raises(TypeError, match="OverRun needs a callable"):
        OverRun(3)
    with pytest.raises(ValueError, match=r"lr_schedule\(0, total=1000\) must return a finite number >= 0, got nan"):
        inner.check_schedule(OverRun(lambda _step, _total: math.nan))
    with pytest.raises(TypeError, match=r"lr_schedule must be a callable .* \(Cosine, .*got float"):
        inner.check_schedule(0.5)


@pytest.mark.parametrize(
    ("schedule", "error", "fragments"),
    [
        (  # torch's LambdaLR form: one argument
            lambda step: 0.95**step,
            TypeError,
            ["lr_schedule must be a callable (epoch, step) -> factor", "lr_schedule(1, 0) raised TypeError"],
        ),
        (  # a torch scheduler class: once "int is not an Optimizer"
            torch.optim.lr_scheduler.CosineAnnealingLR,
            TypeError,
            ["lr_schedule must be a callable (epoch, step)", "torch's CosineAnnealingLR", "lr_schedules.Cosine()"],
        ),
        (
            torch.optim.lr_scheduler.StepLR(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1), 10),
            TypeError,
            ["torch's StepLR", "fn(epoch, step) -> factor"],
        ),
        (OverRun(lambda _step: 1.0), TypeError, ["lr_schedule(0, total=1000) raised TypeError", "(step, total)"]),
        (lambda _epoch, step: math.log(step), ValueError, ["lr_schedule(1, 0) raised ValueError: math domain error"]),
    ],
)
def test_a_schedule_that_fails_its_first_call_is_refused_naming_lr_schedule(schedule, error, fragments):
    with pytest.raises(error) as info:
        inner.check_schedule(schedule)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"


def test_schedules_pickle_as_themselves():
    for schedule in (Cosine(warmup=0.05, final=0.1), Linear(), Constant(0.2)):
        assert pickle.loads(pickle.dumps(schedule)) == schedule


def _spec(schedule, n=100, n_shards=4, batch_size=32, local_epochs=1, max_epochs=3):
    return types.SimpleNamespace(
        run_id="r-lr",
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        optimizer_state="fresh",
        lr_schedule=schedule,
        clip_grad_norm=None,
        shards=Shards(n=n, n_shards=n_shards),
        batch_size=batch_size,
        local_epochs=local_epochs,
        max_epochs=max_epochs,
    )


def test_run_steps_counts_every_shard_of_every_epoch():
    # shards of 25 rows, batches of 10: 3 steps each; two local passes; 3 epochs of 4 shards
    per_shard, total = run_steps(_spec(None, batch_size=10, local_epochs=2))
    assert (per_shard, total) == (6.0, 72)


def test_a_task_steps_on_the_runs_global_clock():
    """A task at place ``position`` starts ``position`` shards of steps into the run and counts on from
    there: a per-task schedule would start again at 0 with every task."""
    seen = []
    spec = _spec(
        OverRun(lambda step, total: seen.append((step, total)) or 0.5), batch_size=8
    )  # 4 steps a shard, 48 in all
    model = torch.nn.Linear(3, 1)
    opt = inner.InnerOptimizer(spec, model, Precision("32", torch.device("cpu")), epoch=2, position=5)
    for _ in range(3):
        opt.step(model(torch.ones(2, 3)).pow(2).mean())
    assert seen == [(20, 48), (21, 48), (22, 48)]
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    opt.done()  # fresh: nothing kept; the base rate would be restored for a kept state
    seen.clear()
    inner.InnerOptimizer(spec, model, Precision("32", torch.device("cpu")), epoch=3).step(model(torch.ones(1, 3)).sum())
    assert seen == [(32, 48)]  # no position (a run dispatched before positions): its epoch's start
    assert lr_schedules.Cosine()(47, 48) < 0.01
