"""A real run's worth of spec for the merge thread's parts (the guard, the probe), without a cluster."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import numpy as np
import torch

import vcdask


def two_shard_spec(tmp_path, **resilience):
    """y = x @ (1, 2, -1) on the 64 rows of shard 0 and y = -x @ (1, 2, -1) on those of shard 1 (data that
    differs by shard as much as it can), in a Zarr group read as the workers read it; a linear model from
    zero, SGD.  Returns the spec and the rows ``x``, ``y``."""
    import xarray as xr

    from vcdask.data import DataSource, Shards
    from vcdask.merge import Probe

    x = np.random.default_rng(0).normal(size=(128, 3)).astype("float32")
    y = x @ np.array([1.0, 2.0, -1.0], dtype="float32")
    y[64:] *= -1
    xr.Dataset({"X": (("sample", "feature"), x), "y": (("sample",), y)}).to_zarr(tmp_path / "d.zarr")
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    spec = SimpleNamespace(
        run_id=f"run-{tmp_path.name}",
        resilience=vcdask.Resilience(**resilience),
        model=model,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05),
        loss=lambda out, target: torch.nn.functional.mse_loss(out.reshape(target.shape), target),
        train_step=None,
        eval_step=None,
        metrics={},
        seed=0,
        batch_size=16,
        train=DataSource(str(tmp_path / "d.zarr"), ("X",), "y", "sample", 128),
        shards=Shards(128, 2),
        validation=None,
        batch_form="xy",
        classification=False,
        x_dtype=torch.float32,
        cast_x=True,
        merge=Probe(),
    )
    return spec, x, y


def core_spec(run_id: str = "run-core", **fields):
    """The spec of a run driven by its core alone (no store, data or training: ``RunState`` of it), with a
    4-shard, 2-epoch plan; ``fields`` replace any of its fields (e.g. ``prices=``)."""
    from vcdask.data import Shards
    from vcdask.spec import RunSpec

    spec = RunSpec(
        run_id=run_id,
        store=SimpleNamespace(location=f"memory://{run_id}"),
        branch=run_id,
        model=torch.nn.Linear(1, 1),
        loss=None,
        optimizer=None,
        local_epochs=1,
        batch_size=8,
        seed=0,
        train=None,
        shards=Shards(40, 4),
        validation=None,
        metrics={},
        classification=True,
        x_dtype=torch.float32,
        max_epochs=2,
        merge=None,
        target=None,
        commit_every=1,
        validate_every="auto",
        keep_updates=False,
        resilience=vcdask.Resilience(),
    )
    return dataclasses.replace(spec, **fields)


def predict_spec(**fields):
    """The fields of a RunSpec that :mod:`vcdask.predict` reads: a classifier of the default step on labels of
    one value per sample, but for ``fields``."""
    base = {
        "batch_form": "xy",
        "feature_names": (),
        "classification": True,
        "x_dtype": torch.float32,
        "cast_x": True,
        "loss": torch.nn.functional.cross_entropy,
        "label_shape": (),
        "train_step": None,
        "label_range": None,
    }
    return SimpleNamespace(**{**base, **fields})
