"""Shards given up (``on_shard_failure="skip"``): the epoch a skip completes keeps the version that ends it,
and a resume neither trains them again nor forgets what the earlier session's epochs measured."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vcdask
from vcdask.engine.end import read_record

POISON = 1e3  # a feature value no real row has: the row its shard cannot train


def _data(n=160, seed=3):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 5)).astype("float32")
    y = (X[:, 0] > X[:, 1]).astype("int64")
    X[-1, 4] = POISON  # the last training row: the pre-flight's few rows are the first ones
    return X, y


def poisoned_step(model, batch):
    """Train as the default step does, but give a batch holding the poisoned row a NaN loss, slowly (the
    other worker goes on meanwhile, into the next epoch): its shard's updates are non-finite, turned down."""
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    if bool((x[:, 4] >= POISON).any()):
        time.sleep(1.0)
        return loss * float("nan")
    return loss


def _epoch_ends(result):
    return {int(v.metadata["step"]) for v in result.store.versions(result.run_id)}


def test_an_epoch_a_skip_completes_keeps_its_end_and_a_resume_trains_no_skipped_shard(client, tmp_path):
    X, y = _data()
    rng = np.random.default_rng(4)
    Xv = rng.normal(size=(40, 5)).astype("float32")
    yv = (Xv[:, 0] > Xv[:, 1]).astype("int64")
    store = tmp_path / "store"
    torch.manual_seed(0)
    first = vcdask.fit(
        torch.nn.Linear(5, 2),
        (X, y),
        train_step=poisoned_step,
        validation=(Xv, yv),
        monitor="loss",
        max_epochs=2,
        n_shards=4,
        resilience=vcdask.Resilience(max_attempts=1, on_shard_failure="skip"),
        retention=vcdask.Retention(keep_last=1),
        client=client,
        store=store,
        progress=False,
    )
    epochs = first.epochs
    assert list(epochs["skipped"]) == [1, 1]  # the poisoned shard, once an epoch
    skipped = first.history[first.history["outcome"] == "skipped"]
    assert len(skipped) == 2 and skipped["shard"].nunique() == 1
    bad = int(skipped["shard"].iloc[0])
    assert first.notes[0].startswith(f"skipped: 2 shard(s) given up (on_shard_failure='skip'): shard {bad} of epoch")
    # every epoch's end version is still in the store (retention keeps them, whatever the epoch of its
    # last merge), validated, and the best of them loads
    kept = _epoch_ends(first)
    assert {int(v) for v in epochs["version"]} <= kept, (epochs, sorted(kept))
    assert first.best_version is not None
    best = vcdask.load(first.store, torch.nn.Linear(5, 2), version=first.best_version)
    assert best.vcdask_version["id"] == first.best_version
    # the run's progress (the versions', and the record's for what came after the last commit): both
    # epochs done, each at its end's step, the skipped shard open nowhere
    progress = read_record(first.store, first.run_id)["progress"]
    assert sorted(progress["done"]) == [[e, int(v)] for e, v in zip(epochs.index, epochs["version"], strict=True)]
    assert progress["open"] == [] and progress["skipped"] == []
    for v in first.store.versions(first.run_id):
        assert all(shard != bad for _, shard, _ in v.metadata.get("progress", {}).get("open", []))

    more = vcdask.resume(first.run_id, store=store, client=client, max_epochs=3, progress=False)
    trained = more.history[more.history["accepted"]]
    assert set(trained["epoch"]) == {3}  # epochs 1 and 2 are done: the skipped shard is not trained again
    assert sorted(trained["shard"]) == sorted(s for s in range(4) if s != bad)
    rows = more.epochs
    assert list(rows.index) == [1, 2, 3] and list(rows["skipped"]) == [1, 1, 1]
    for epoch in (1, 2):  # what the first session measured, not NaN
        assert math.isfinite(rows.loc[epoch, "train_loss"]) and math.isfinite(rows.loc[epoch, "wall_time"])
        assert rows.loc[epoch, "train_loss"] == epochs.loc[epoch, "train_loss"]


def raising_step(model, batch):
    """The default step, but a batch holding a poisoned row raises (a corrupt sample, as a Dataset would)."""
    x, y = batch
    if bool((x[:, 4] >= POISON).any()):
        raise ValueError("a corrupt sample")
    return F.cross_entropy(model(x), y)


def _fit_raising(data, max_attempts: int, client, tmp_path):
    """Two epochs of 4 shards with :func:`raising_step`, giving a shard up after ``max_attempts``."""
    torch.manual_seed(0)
    return vcdask.fit(
        torch.nn.Linear(5, 2),
        data,
        train_step=raising_step,
        max_epochs=2,
        n_shards=4,
        resilience=vcdask.Resilience(max_attempts=max_attempts, on_shard_failure="skip"),
        client=client,
        store=tmp_path / "store",
        progress=False,
    )


def test_a_shard_whose_step_raises_is_tried_elsewhere_then_given_up_and_the_run_goes_on(client, tmp_path):
    """Under ``on_shard_failure="skip"`` an error in the step (or loss, or Dataset) on one shard is an attempt
    of that shard: tried again on another worker, given up after ``max_attempts``; no worker is blamed."""
    result = _fit_raising(_data(), 2, client, tmp_path)
    h = result.history
    failed = h[h["outcome"] == "failed"]
    assert len(failed) == 4 and failed["shard"].nunique() == 1  # two attempts an epoch
    assert failed["reason"].str.startswith("failed: ValueError('a corrupt sample')").all()
    for epoch in (1, 2):  # the second attempt went to the other worker
        assert failed[failed["epoch"] == epoch]["worker"].nunique() == 2
    assert list(result.epochs["skipped"]) == [1, 1] and h["accepted"].sum() == 6
    assert not result.workers["excluded"].any() and (result.workers["failed"] == 0).all()


def test_an_epoch_whose_every_shard_is_given_up_fails_the_run(client, tmp_path):
    """Nothing of the epoch trained: the data, the step or the loss fail on every shard; the run says so
    rather than ending as if it had trained."""
    X, y = _data()
    X[[10, 50, 90, 130], 4] = POISON  # a poisoned row in every shard (the pre-flight's first rows are clean)
    with pytest.raises(vcdask.RunFailedError, match=r"every shard of epoch 1 was given up, none merged"):
        _fit_raising((X, y), 1, client, tmp_path)
