"""A run's seeds (vcdask._seeds): each task's batch order and its dropout come from ``(seed, epoch, shard,
attempt)``, any seed >= 0 works, and the process that called ``fit`` keeps its own torch generator."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import vcdask
from vcdask._seeds import derived_seeds, task_rng


def test_derived_seeds_take_any_seed_and_never_collide():
    """The old key ``seed * 1_000_003 + epoch * 10_007 + shard * 101 + attempt`` overflowed torch for seeds from
    about 9.2e12 (``time.time_ns()``: every task failed) and gave (1, 99, 8) and (2, 0, 0) one key."""
    for seed in (0, 2**45, 2**64, 1_764_000_000_000_000_000):
        for s in derived_seeds(seed, 1, 2, 3):
            assert 0 <= s < 2**63
            torch.Generator().manual_seed(s)
    keys = [derived_seeds(7, e, s, a) for e, s, a in itertools.product(range(1, 4), range(120), range(10))]
    flat = [k for pair in keys for k in pair]
    assert len(set(flat)) == len(flat)
    assert derived_seeds(7, 1, 99, 8) != derived_seeds(7, 2, 0, 0)
    assert derived_seeds(7, 1, 2, 3) == derived_seeds(7, 1, 2, 3)


def test_task_rng_seeds_inside_and_puts_the_generator_back():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with task_rng(5):
        inside = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    with task_rng(5):
        assert torch.equal(torch.rand(3), inside)


class _Dropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3))
        self.out = torch.nn.Linear(32, 2)

    def forward(self, x):
        return self.out(self.net(x))


@pytest.fixture
def xy():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(240, 8)).astype("float32")
    return X, (X[:, 0] - X[:, 1] > 0).astype("int64")


def _fit(client, xy, tmp_path, name, model=None, **kwargs):
    model = _Dropout() if model is None else model
    return vcdask.fit(
        model, xy, client=client, store=tmp_path / name, max_epochs=2, n_shards=3, progress=False, **kwargs
    )


def test_one_worker_and_one_seed_train_alike_with_dropout_whatever_the_callers_generator(threaded_client, xy, tmp_path):
    """``seed=`` seeds dropout: it drew from the worker process's generator (and, on an in-process cluster, from
    the caller's, which each run advanced), so two runs with one seed ended with other weights.  The caller's
    generator is left as it was, the scheduler's probe (robust merging) included."""
    weights, states = [], []
    for i, own in enumerate((1, 2)):
        model = _Dropout()
        torch.manual_seed(own)
        before = torch.get_rng_state()
        robust = vcdask.Resilience(max_norm_ratio=3.0, min_cosine=0.0)
        result = _fit(threaded_client, xy, tmp_path, f"s{i}", model, seed=4, resilience=robust)
        states.append(torch.equal(torch.get_rng_state(), before))
        weights.append(torch.cat([p.detach().flatten() for p in result.model.parameters()]))
    assert states == [True, True]
    assert torch.equal(weights[0], weights[1])
    other = _fit(threaded_client, xy, tmp_path, "other", seed=5)
    assert not torch.equal(torch.cat([p.detach().flatten() for p in other.model.parameters()]), weights[0])


def test_a_seed_from_the_clock_trains(threaded_client, xy, tmp_path):
    """A seed such as ``time.time_ns()`` passed the checks, then every shard task failed ('Overflow when unpacking
    long long') and the run ended with RunFailedError."""
    result = _fit(threaded_client, xy, tmp_path, "clock", seed=1_764_000_000_000_000_000)
    assert result.history["epoch"].max() == 2


def test_one_worker_waiting_for_its_merge_trains_alike_with_any_rule(threaded_client, xy, tmp_path):
    """The documented recipe for runs alike to the bit: one worker of one thread and ``overlap="wait"``, whatever
    the merge rule (with ``"delta"`` a task's correction comes at a step that depends on timing)."""
    import dask

    weights = []
    with dask.config.set({"vcdask.worker.overlap": "wait"}):
        for i in range(2):
            result = _fit(threaded_client, xy, tmp_path, f"w{i}", seed=1, alpha=0.5)
            weights.append(torch.cat([p.detach().flatten() for p in result.model.parameters()]))
    assert torch.equal(weights[0], weights[1])


def test_the_demo_model_leaves_the_callers_generator():
    from vcdask.demo import digits_cnn

    torch.manual_seed(9)
    before = torch.get_rng_state()
    a, b = digits_cnn(3), digits_cnn(3)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.gpu
def test_task_rng_on_cuda_seeds_the_tasks_device_and_puts_it_back():
    """A CUDA task's dropout draws from its device's generator: seeded for the task, put back after (and the CPU's
    too); ``torch.manual_seed`` would have reseeded every GPU of the process and put back one."""
    device = torch.device("cuda", 0)
    torch.cuda.manual_seed(11)
    before, cpu = torch.cuda.get_rng_state(0), torch.get_rng_state()
    with task_rng(5, device):
        inside = torch.rand(3, device=device)
    assert torch.equal(torch.cuda.get_rng_state(0), before) and torch.equal(torch.get_rng_state(), cpu)
    with task_rng(5, torch.device("cuda")):  # (no index: the current device)
        assert torch.equal(torch.rand(3, device=device), inside)
