"""fit with devices, precisions, custom steps and every kind of data (real workers, real training)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import xarray as xr
from chaos_helpers import worker_info

import vcdask


def _mlp(seed=0, d_in=64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(d_in, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _fit(model, data, client, tmp_path, **kw):
    kw = {"max_epochs": 3, "n_shards": 4, "lr": 3e-3, "progress": False, **kw}
    return vcdask.fit(model, data, client=client, store=str(tmp_path / "store"), **kw)


def test_cpu_device_is_recorded_per_update_and_worker(client, tmp_path, digits_data):
    (X, y), val = digits_data
    result = _fit(_mlp(), (X, y), client, tmp_path, validation=val, device="cpu")
    merged = result.history[result.history.outcome == "merged"]
    assert set(merged.device) == {"cpu"}
    assert set(result.workers.device) == {"cpu"}
    assert result.metrics["accuracy"] > 0.6


def test_bf16_autocast_on_cpu_trains(client, tmp_path, digits_data):
    (X, y), val = digits_data
    result = _fit(_mlp(), (X, y), client, tmp_path, validation=val, precision="bf16")
    assert result.model[1].weight.dtype == torch.float32  # parameters stay float32; the forward pass is bf16
    assert result.metrics["accuracy"] > 0.6


def _two_inputs(X, y):
    flat = X.reshape(len(X), -1)
    return {"left": flat[:, :32].copy(), "right": flat[:, 32:].copy(), "label": y}


class TwoTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.left, self.right = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, left, right):
        return self.head(torch.relu(torch.cat([self.left(left), self.right(right)], dim=1)))


def two_tower_step(model, batch):
    return F.cross_entropy(model(batch["left"], batch["right"]), batch["label"])


def two_tower_eval(model, batch):
    out = model(batch["left"], batch["right"])
    return {"loss": F.cross_entropy(out, batch["label"]), "acc": (out.argmax(1) == batch["label"]).float().mean()}


def test_train_step_over_dict_batches_with_eval_step_metrics(client, tmp_path, digits_data):
    (X, y), (Xv, yv) = digits_data
    result = _fit(
        TwoTower(),
        _two_inputs(X, y),
        client,
        tmp_path,
        validation=_two_inputs(Xv, yv),
        train_step=two_tower_step,
        eval_step=two_tower_eval,
        target={"acc": 0.99},
    )
    assert {"loss", "acc", "acc_mean", "acc_min", "acc_max"} <= set(result.epochs.columns)
    assert len(result.epochs) == 3 and result.epochs["acc"].iloc[-1] > 0.6
    assert set(result.metrics) == {"loss", "acc"}
    # the numbers are the eval step's, averaged over the validation set: recompute on the final model
    model = result.model.eval()
    with torch.no_grad():
        data = {k: torch.as_tensor(v) for k, v in _two_inputs(Xv, yv).items()}
        acc = float((model(data["left"], data["right"]).argmax(1) == data["label"]).float().mean())
    assert result.metrics["acc"] == pytest.approx(acc, abs=1e-6)


def test_xarray_dataset_with_several_inputs_gives_dict_batches(client, tmp_path, digits_data):
    (X, y), _ = digits_data
    parts = _two_inputs(X, y)
    ds = xr.Dataset({k: (("sample", *[f"{k}_{i}" for i in range(1, v.ndim)]), v) for k, v in parts.items()})
    result = _fit(TwoTower(), ds, client, tmp_path, validation=0.2, train_step=two_tower_step)
    assert list(result.epochs["loss"]) == sorted(result.epochs["loss"], reverse=True)  # validation loss falls


class DigitsDataset(torch.utils.data.Dataset):
    """Map-style: items (image as float64, label), as a user's dataset might give them."""

    def __init__(self, X, y):
        self.X, self.y = X.astype(np.float64), y

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return torch.from_numpy(self.X[i]), int(self.y[i])


def flip_collate(items):
    xs, ys = zip(*items, strict=True)
    return torch.stack(xs).flip(-1), torch.tensor(ys)


@pytest.mark.parametrize("collate_fn", [None, flip_collate])
def test_map_style_dataset_is_sharded_by_index_ranges(client, tmp_path, digits_data, collate_fn):
    (X, y), (Xv, yv) = digits_data
    result = _fit(
        _mlp(), DigitsDataset(X, y), client, tmp_path, validation=DigitsDataset(Xv, yv), collate_fn=collate_fn
    )
    assert result.metrics["accuracy"] > 0.45  # chance is 0.1
    assert len(result.history[result.history.outcome == "merged"]) == 12


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


def test_integer_inputs_reach_the_model_as_integers(client, tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 16, size=(400, 8))
    nxt = (tokens + 1) % 16  # learnable: the next token is one more

    def loss(out, target):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    result = _fit(TinyLM(), (tokens, nxt), client, tmp_path, loss=loss, validation=0.2, lr=0.05, metrics=[])
    assert result.epochs["loss"].iloc[-1] < 1.0  # from ln(16) = 2.8


def test_worker_optimizer_state_with_schedule_and_clipping(client, tmp_path, digits_data):
    (X, y), val = digits_data
    result = _fit(
        _mlp(),
        (X, y),
        client,
        tmp_path,
        validation=val,
        optimizer_state="worker",
        lr=1e-2,
        lr_schedule=lambda epoch, step: min(1.0, (step + 1) / 3) * 0.8 ** (epoch - 1),
        clip_grad_norm=1.0,
    )
    assert result.metrics["accuracy"] > 0.6


def _held_for(run_id):
    """What this worker process keeps for run ``run_id``: model copies (every thread's), hand-overs, optimizer
    states, compressed updates' residuals, the versions its tasks loaded, its share of a shard's batches."""
    from vcdask import _held, compress, inner, overlap, worker

    with _held._lock:
        models = sum(1 for by_run in list(_held._every_thread.values()) for key in by_run if key[0] == run_id)
        versions = sum(
            1 for version, run in _held._version_runs.items() if run == run_id and version in _held._versions
        )
    return {
        "models": models,
        "hand_overs": len(overlap._pending.get(run_id, ())),
        "optimizer_states": len(inner._kept.get(run_id, ())),
        "residuals": len(compress._residuals.get(run_id, ())),
        "versions": versions,
        "fractions": int(run_id in worker._fractions),
    }


def test_a_run_that_ends_leaves_nothing_of_its_own_on_its_workers(client, tmp_path, digits_data):
    """Each worker drops a run's model copies, optimizer states, hand-overs, residuals and the versions it loaded
    when the run ends (on a GPU they are its memory: about 4 model sizes a worker thread, kept for runs long gone
    before; the versions, pinned host memory, 4 model sizes a worker process), and its share of the shards."""
    (X, y), val = digits_data
    handle = _fit(
        _mlp(), (X, y), client, tmp_path, max_epochs=6, optimizer_state="worker", compression="int8", wait=False
    )
    deadline = time.monotonic() + 60
    held: dict = {}
    kept = ("models", "optimizer_states", "residuals", "versions")
    while time.monotonic() < deadline and not handle.done():
        held = client.run(_held_for, handle.run_id)
        if all(all(h[k] for k in kept) for h in held.values()):
            break  # (every worker trained, and keeps what it keeps between its tasks)
        time.sleep(0.05)
    assert held and all(all(h[k] for k in kept) for h in held.values()), held
    result = handle.result()
    assert (result.history.outcome == "merged").all()
    deadline = time.monotonic() + 10  # (the run says it ended, then lets go of its workers' caches)
    left = client.run(_held_for, handle.run_id)
    while any(any(h.values()) for h in left.values()):
        assert time.monotonic() < deadline, left
        time.sleep(0.05)
        left = client.run(_held_for, handle.run_id)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["32", "bf16", "16-mixed"])
@pytest.mark.parametrize("optimizer_state", ["auto", "worker"])
def test_cuda_training(client, tmp_path, digits_data, precision, optimizer_state):
    """On CUDA, with the defaults and with each worker's optimizer state kept (Adam's ``step`` on the CPU,
    its moments on the GPU: every such run once failed, see ``vcdask.testing.devices``)."""
    (X, y), val = digits_data
    result = _fit(
        _mlp(),
        (X, y),
        client,
        tmp_path,
        validation=val,
        device="cuda",
        precision=precision,
        optimizer_state=optimizer_state,
    )
    assert all(d.startswith("cuda:") for d in result.history.device.dropna())
    assert (result.history.outcome == "merged").all(), result.history[["outcome", "reason"]]
    assert result.metrics["accuracy"] > 0.6
    assert next(result.model.parameters()).device.type == "cpu"  # parameters come back to the caller on CPU


@pytest.mark.gpu
def test_a_model_on_the_gpu_is_checked_and_staged_on_the_cpu_and_gets_its_result_there(client, tmp_path, digits_data):
    """``fit(model.cuda(), ...)``: the checks and the staged copy are made on the CPU without a second copy on
    the GPU (``cpu_copy``), and the caller's model, on its GPU, holds the run's result."""
    from vcdask.device import cpu_copy

    (X, y), val = digits_data
    model = _mlp().cuda()
    allocated = torch.cuda.memory_allocated()
    assert next(cpu_copy(model).parameters()).device.type == "cpu"
    assert torch.cuda.memory_allocated() == allocated
    result = _fit(model, (X, y), client, tmp_path, validation=val, device="cuda")
    assert result.model is model and {p.device.type for p in model.parameters()} == {"cuda"}
    assert (result.history.outcome == "merged").all(), result.history[["outcome", "reason"]]
    assert result.metrics["accuracy"] > 0.6


@pytest.mark.gpu
def test_cuda_training_with_four_tasks_in_flight_chooses_its_rule_on_the_schedulers_cpu(client, tmp_path, digits_data):
    """fit's default for 4 tasks in flight ("auto") times its probe on the scheduler's CPU against CUDA tasks
    and merges with what it chose; the probe's copy of the model stays on the CPU."""
    (X, y), val = digits_data
    result = _fit(_mlp(), (X, y), client, tmp_path, validation=val, device="cuda", tasks_per_slot=2, max_epochs=2)
    assert all(d.startswith("cuda:") for d in result.history.device.dropna())
    assert (result.history.outcome == "merged").all(), result.history[["outcome", "reason"]]
    head = result.store.read(result.version).metadata
    state = head["rule_state"]
    assert head["merge"]["name"] == "auto" and "probe_error" not in state, state
    assert state["chosen"] == ("probe" if 4 * state["probe_seconds"] / state["task_seconds"] <= 0.75 else "nesterov")
    assert result.metrics["accuracy"] > 0.6


def _gpu_and_cpu_worker():
    """A cluster of two workers on this machine: one sees its GPUs, the other none (``CUDA_VISIBLE_DEVICES=""``)."""
    from distributed import Nanny, Scheduler, SpecCluster

    workers = {
        "gpu": {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1"}},
        "cpu": {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1", "env": {"CUDA_VISIBLE_DEVICES": ""}}},
    }
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}}
    return SpecCluster(workers=workers, scheduler=scheduler)


@pytest.mark.gpu
@pytest.mark.cluster
def test_one_run_mixes_cuda_and_cpu_workers(tmp_path, digits_data):
    from distributed import Client

    (X, y), val = digits_data
    with _gpu_and_cpu_worker() as cluster, Client(cluster) as c:
        result = _fit(_mlp(), (X, y), c, tmp_path, validation=val, max_epochs=4)
    devices = set(result.history[result.history.outcome == "merged"].device)
    assert "cpu" in devices and any(d.startswith("cuda:") for d in devices), devices
    assert result.metrics["accuracy"] > 0.6


@pytest.mark.gpu
@pytest.mark.cluster
def test_device_cuda_on_a_mixed_fleet_trains_on_its_gpus_only(tmp_path, digits_data):
    """``device="cuda"``: the worker without one gets no shards (it ended the run at its first task)."""
    from distributed import Client

    (X, y), val = digits_data
    with _gpu_and_cpu_worker() as cluster, Client(cluster) as c:
        result = _fit(_mlp(), (X, y), c, tmp_path, validation=val, max_epochs=2, device="cuda")
    merged = result.history[result.history.outcome == "merged"]
    assert all(d.startswith("cuda:") for d in merged.device), set(merged.device)
    assert result.metrics["accuracy"] > 0.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks workers without CUDA")
def test_device_cuda_on_workers_without_one_is_refused_before_the_run(client, tmp_path, digits_data):
    """Every worker lacks the device: refused naming it, before anything is staged (the run failed at its first
    task; excluding each worker instead would wait no_worker_timeout for one that has it)."""
    from vcdask.errors import DeviceUnavailableError

    (X, y), _ = digits_data
    with pytest.raises(DeviceUnavailableError, match=r"device='cuda', but none of the cluster's 2 workers has it"):
        _fit(_mlp(), (X, y), client, tmp_path, device="cuda")
    assert [b for b in vcdask.open_store(str(tmp_path / "store")).branches() if b.startswith("run-")] == []


class _SlowOn:
    """The default step, sleeping ``delay`` s per batch on the worker at ``address`` (a slower machine) and
    ``others`` s on every other worker (so a run lasts long enough for the slow worker to be measured)."""

    def __init__(self, address, delay, others=0.0):
        self.address, self.delay, self.others = address, delay, others

    def __call__(self, model, batch):
        import time

        from distributed import get_worker

        try:
            time.sleep(self.delay if get_worker().address == self.address else self.others)
        except ValueError:  # the probe, on the client
            pass
        x, y = batch
        return F.cross_entropy(model(x), y)


def test_speed_adaptive_gives_a_slow_worker_a_share_of_its_shard(client, tmp_path, digits_data):
    (X, y), val = digits_data
    slow = sorted(worker_info(client))[1]
    result = _fit(
        _mlp(),
        (X, y),
        client,
        tmp_path,
        validation=val,
        max_epochs=8,
        # 5x slower per step; without the 10 ms on the fast worker, it trained all 32 shards (0.06 s each)
        # before the slow worker's first task, cold start included, was back
        train_step=_SlowOn(slow, 0.05, others=0.01),
        speed_adaptive=True,
    )
    h = result.history
    merged = h[h.outcome == "merged"]
    assert len(merged) == 8 * 4 and not merged.duplicated(["epoch", "shard"]).any()  # every shard, once
    assert (merged[merged.worker != slow].fraction == 1.0).all()
    on_slow = merged[merged.worker == slow]
    assert len(on_slow) >= 1
    # its first tasks measure its speed (whole shards); later ones train a share of their shard
    assert (on_slow.fraction >= 0.1).all() and (on_slow.fraction < 0.8).any()
    from vcdask.demo import accuracy_on

    assert accuracy_on(result.model, *val) > 0.6
