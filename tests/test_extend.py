"""resume(run_id, max_epochs=N) gives a finished run more epochs; every run records where it started."""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pytest
import torch

import vcdask


def _data(n=180, seed=1):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 5)).astype("float32")
    return X, (X[:, 0] > X[:, 1]).astype("int64")


def test_resume_extends_a_finished_run_and_merges_nothing_twice(client, tmp_path):
    X, y = _data()
    torch.manual_seed(0)
    store = tmp_path / "store"
    first = vcdask.fit(
        torch.nn.Linear(5, 2), (X, y), max_epochs=1, n_shards=3, retention=False, client=client, store=store
    )
    assert first.start is None  # a fresh model
    assert first.store.versions(first.run_id)[-1].metadata["start"] is None

    with pytest.raises(ValueError, match=r"max_epochs=1 would not extend run .*done 1 epochs.*max_epochs > 1"):
        vcdask.resume(first.run_id, store=store, client=client, max_epochs=1)

    from vcdask.spec import load_spec

    assert load_spec(first.store, first.run_id).max_epochs == 1  # cached in this process from here on
    more = vcdask.resume(first.run_id, store=store, client=client, max_epochs=3, progress=False)
    assert load_spec(first.store, first.run_id).max_epochs == 3  # save_spec refreshed the cache
    assert more.run_id == first.run_id and more.stop_reason is None
    merged = more.history[more.history["accepted"]]
    assert sorted(zip(merged["epoch"], merged["shard"], strict=True)) == [(e, s) for e in (2, 3) for s in range(3)]
    # the store: every (epoch, shard) merged by exactly one version, steps 0..9 without a gap
    versions = list(reversed(more.store.versions(more.run_id)))
    assert [v.metadata["step"] for v in versions] == list(range(10))
    assert "(step 9) on branch" in more._repr_html_()  # the run's step, not this session's 6 merges
    counts = Counter((e, s) for v in versions for e, s, _ in v.metadata["merged"])
    assert sorted(counts) == [(e, s) for e in (1, 2, 3) for s in range(3)] and set(counts.values()) == {1}
    assert versions[1].metadata["merged"] == first.store.versions(first.run_id)[-2].metadata["merged"]
    # the spec keeps the new total: asking for 3 again is refused, naming both numbers
    with pytest.raises(ValueError, match=r"max_epochs=3 would not extend .*done 3 epochs.*max_epochs > 3"):
        vcdask.resume(first.run_id, store=store, client=client, max_epochs=3)
    with pytest.raises(ValueError, match="max_epochs must be"):
        vcdask.resume(first.run_id, store=store, client=client, max_epochs=0)


def test_the_epochs_a_resume_adds_train_at_the_rates_of_the_longer_schedule_on_the_same_workers(client, tmp_path):
    """The workers that trained the first run must not keep its spec: a schedule over the run reads the
    run's length from it, and with the first run's length the added epochs lie past its end (a rate of
    0 with ``Linear()``'s default ``final``: nothing would train)."""
    X, y = _data()
    torch.manual_seed(0)
    options = dict(n_shards=3, merge="vc-asgd", lr_schedule=vcdask.lr_schedules.Linear(), client=client)
    first = vcdask.fit(torch.nn.Linear(5, 2), (X, y), max_epochs=1, store=tmp_path / "s", **options)
    assert set(client.run(_cached_specs, first.run_id).values()) == {0}  # the run's end let go of them
    with pytest.warns(UserWarning, match=r"its factor, 0.167 at the run's last step, is 0.667 at epoch 2's first"):
        more = vcdask.resume(first.run_id, store=tmp_path / "s", client=client, max_epochs=3, progress=False)
    moved = max(
        (a - b).abs().max().item() for a, b in zip(more.model.parameters(), first.model.parameters(), strict=True)
    )
    assert moved > 1e-3  # (at a rate of 0 every update is its base: the vc-asgd merges leave W_s as it is)


def test_extending_a_run_says_where_its_schedule_over_the_run_starts_again():
    """A finished ``Cosine()`` run given more epochs starts them part way up the longer run's schedule (the
    documented ``total``, which counts ``max_epochs`` passes): said, with both factors, and what to do instead."""
    from types import SimpleNamespace

    from vcdask.data import Shards
    from vcdask.extend import schedule_restart

    def spec(schedule, max_epochs=2):  # 2 shards of 64 rows, batches of 32: 2 steps a shard, 4 an epoch
        return SimpleNamespace(lr_schedule=schedule, shards=Shards(128, 2), batch_size=32, local_epochs=1,
                               max_epochs=max_epochs)  # fmt: skip

    note = schedule_restart(spec(vcdask.lr_schedules.Cosine(final=0.01)), 2, 4)
    assert "from 2 epochs to 4 it is a 4-epoch run's: its factor, 0.0477 at the run's last step, is 0.505" in note
    assert "vcdask.fit(result.model, data, lr_schedule=...)" in note
    assert schedule_restart(spec(vcdask.lr_schedules.Constant(warmup=0.1)), 2, 4) is None  # nothing changes
    assert schedule_restart(spec(lambda _epoch, _step: 0.5), 2, 4) is None  # per task: by epoch and step
    assert schedule_restart(spec(None), 2, 4) is None


def _cached_specs(run_id: str) -> int:
    from vcdask.spec import _specs

    return sum(key[1] == run_id for key in list(_specs))


def test_two_resumes_at_once_drive_the_run_once(client, tmp_path):
    """Two resumes of one run arriving together (a retried job and a notebook) start one driver: the
    second waits for the first's start and joins it; nothing is merged twice."""
    import asyncio
    import pickle

    X, y = _data()
    torch.manual_seed(0)
    first = vcdask.fit(torch.nn.Linear(5, 2), (X, y), max_epochs=1, n_shards=3, retention=False, client=client,
                       store=tmp_path / "s", progress=False)  # fmt: skip
    store = pickle.dumps(first.store)

    async def both(dask_scheduler, store, run_id):  # (on the scheduler: the two handlers interleave for certain)
        start = dask_scheduler.plugins["vcdask"].handle_start
        ids = await asyncio.gather(*(start(store=store, run_id=run_id, resume=True, max_epochs=2) for _ in "ab"))
        drivers = [
            t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "Run.drive" and not t.done()
        ]
        return ids, sum(t.get_coro().cr_frame.f_locals["self"].id == run_id for t in drivers)

    assert client.run_on_scheduler(both, store=store, run_id=first.run_id) == ([first.run_id] * 2, 1)
    client.sync(client.scheduler.vcdask_wait, run_id=first.run_id, timeout=120)
    versions = list(reversed(first.store.versions(first.run_id)))
    assert [v.metadata["step"] for v in versions] == list(range(7))  # 3 merges an epoch, once each
    counts = Counter((e, s) for v in versions for e, s, _ in v.metadata["merged"])
    assert sorted(counts) == [(e, s) for e in (1, 2) for s in range(3)] and set(counts.values()) == {1}


def test_a_live_run_cannot_be_extended_and_its_spec_is_left_alone(client, tmp_path):
    from vcdask.engine.end import read_record
    from vcdask.spec import loads, spec_path

    X, y = _data()
    store = tmp_path / "store"
    handle = vcdask.fit(
        torch.nn.Linear(5, 2), (X, y), max_epochs=400, n_shards=2, client=client, store=store, wait=False
    )
    try:
        with pytest.raises(ValueError, match=r"is still going .*wait for it to end \(or cancel it\)"):
            vcdask.resume(handle.run_id, store=store, client=client, max_epochs=800, wait=False)
        param_store = vcdask.open_store(store)
        assert loads(param_store.files.get(spec_path(handle.run_id))).max_epochs == 400
        # the run's record has each epoch as it closes, while it runs: a resume after a crash shows them
        deadline = time.monotonic() + 60
        while len((read_record(param_store, handle.run_id) or {}).get("epochs") or ()) < 2:
            assert time.monotonic() < deadline, read_record(param_store, handle.run_id)
            time.sleep(0.1)
        rec = read_record(param_store, handle.run_id)
        assert rec["status"] == "running" and [r["epoch"] for r in rec["epochs"][:2]] == [1, 2]
        assert rec["scheduler"] == client.scheduler.address  # (where a resume elsewhere asks whether it still runs)
        assert math.isfinite(rec["epochs"][0]["train_loss"]) and math.isfinite(rec["epochs"][0]["wall_time"])
        assert rec["step"] >= 2 and [1, rec["epochs"][0]["version"]] in rec["progress"]["done"]  # (the merge thread's)
    finally:
        handle.cancel()


def test_a_run_records_the_version_and_tag_it_started_from(client, tmp_path):
    X, y = _data()
    torch.manual_seed(0)
    store = tmp_path / "store"
    first = vcdask.fit(torch.nn.Linear(5, 2), (X, y), max_epochs=1, n_shards=2, client=client, store=store)
    param_store = vcdask.open_store(str(store), mode="r+")
    param_store.tag("release-1", first.version)

    warm = vcdask.load(str(store), tag="release-1")
    assert warm.vcdask_version["tag"] == "release-1" and warm.vcdask_version["id"] == first.version
    second = vcdask.fit(warm, (X, y), max_epochs=1, n_shards=2, client=client, store=store, progress=False)
    expected = {"version": first.version, "tag": "release-1", "store": param_store.location}
    assert second.start == expected
    initial = second.store.versions(second.run_id)[-1]
    assert initial.metadata["step"] == 0 and initial.metadata["start"] == expected
    assert vcdask.load(param_store, branch=second.run_id).vcdask_version["id"] == second.version
    # the warm start really started there: the initial version holds the tagged parameters
    tagged = param_store.read(tag="release-1").state_dict()
    for name, value in param_store.read(initial.id).state_dict().items():
        assert torch.equal(value, tagged[name])
    # a model a fit returned continues from that run's last version (no tag)
    third = vcdask.fit(second.model, (X, y), max_epochs=1, n_shards=2, client=client, store=store, progress=False)
    assert third.start == {"version": second.version, "tag": None, "store": param_store.location}
