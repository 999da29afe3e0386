"""The copy of a run's data staged in its store goes ``Retention.keep_staged_for`` after the run ended: at the
end of a later run, or at a collection (``ParamStore.gc``, ``vcdask gc``); before, a store used by a nightly job
kept every night's copy for good.  A run whose data went is refused by ``resume`` with what to do; its model
still loads."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import vcdask
from vcdask.cli import main
from vcdask.engine.end import write_record
from vcdask.store._runs import GONE, check_staged, sweep_staged


def _data(n=160, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 4)).astype("float32")
    return X, (X[:, 0] > X[:, 1]).astype("int64")


def _fit(client, store, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return vcdask.fit(
        model, _data(), validation=0.25, max_epochs=1, n_shards=2, client=client, store=store, progress=False, **kwargs
    )


def _staged(store, run_id) -> list[str]:
    return [p for p in ("train.zarr", "validation.zarr") if store.files.nbytes(f"{run_id}/{p}")]


def test_a_runs_staged_data_goes_by_its_retention_and_its_model_still_loads(client, tmp_path, capsys):
    path = tmp_path / "store"
    kept = _fit(client, path)  # the default policy: a week
    store = vcdask.open_store(path)
    assert _staged(store, kept.run_id) == ["train.zarr", "validation.zarr"]
    gone = _fit(client, path, retention=vcdask.Retention(keep_staged_for=0))
    # its own end removed its data (its time was up at once); the other run's week is not up
    assert _staged(store, gone.run_id) == [] and _staged(store, kept.run_id) == ["train.zarr", "validation.zarr"]
    assert store.files.exists(f"{gone.run_id}/{GONE}")
    loaded = vcdask.load(store, branch=gone.run_id)
    X = torch.from_numpy(_data()[0])
    assert torch.equal(loaded(X), gone.model(X))
    with pytest.raises(FileNotFoundError, match=rf"run '{gone.run_id}' cannot be resumed: the copy of its data"):
        vcdask.resume(gone.run_id, store=path, client=client, max_epochs=2)
    said = r"\(its own Retention, keep_staged_for=0\).*vcdask\.fit\(vcdask\.load\("
    with pytest.raises(FileNotFoundError, match=said):
        vcdask.resume(gone, client=client, max_epochs=2)

    # a collection goes by each run's own policy: the kept run's week is not up
    assert store.gc(vcdask.Retention(keep_staged_for=0), dry_run=True).staged_removed == {}
    # vcdask gc --keep-staged-days: every run's, whatever its own; a dry run says what would go, removing nothing
    assert main(["gc", str(path), "--keep-staged-days", "0", "--dry-run"]) == 0
    assert f"{kept.run_id}: would remove its staged data (" in capsys.readouterr().out
    assert _staged(store, kept.run_id) == ["train.zarr", "validation.zarr"]
    assert main(["gc", str(path), "--keep-staged-days", "0"]) == 0
    out = capsys.readouterr().out
    assert f"{kept.run_id}: removed its staged data (" in out and f"{gone.run_id}: removed its staged" not in out
    assert _staged(store, kept.run_id) == []
    with pytest.raises(FileNotFoundError, match=r"cannot be resumed.*\(a collection, keep_staged_for=0\.0\)"):
        vcdask.resume(kept.run_id, store=path, client=client, max_epochs=2)
    assert store.gc(vcdask.Retention(keep_staged_for=0)).staged_removed == {}  # (nothing left to remove)


def test_a_resume_whose_data_went_after_it_looked_fails_with_the_refusal(client, tmp_path):
    """resume() looks for the marker first; a collection that removes the data after that look (another run's end)
    is seen by the resumed run itself, once it has written its record: it fails with the same message, rather
    than its workers failing to read a group that is gone."""
    from vcdask.errors import RunFailedError
    from vcdask.runs import _start  # (what resume() calls once its own look found nothing)

    path = tmp_path / "store"
    first = _fit(client, path)
    store = vcdask.open_store(path)
    staged = _bytes(store, first)
    assert staged > 1000 and sweep_staged(store.files, override=0.0) == {first.run_id: staged}
    handle = _start(client, store, first.run_id, resume=True, max_epochs=2)
    with pytest.raises(RunFailedError, match=rf"run '{first.run_id}' cannot be resumed: the copy of its data"):
        handle.result()


def _bytes(store, result) -> int:
    return sum(store.files.nbytes(f"{result.run_id}/{p}") or 0 for p in ("train.zarr", "validation.zarr"))


def _ended(store, run_id, *, status="finished", ended=None, keep=0.0, staged=("train.zarr",)):
    """A run's record as the engine writes it at the run's end, and the staged groups it names."""
    for name in staged:
        store.files.put(f"{run_id}/{name}/zarr.json", b"{}")
        store.files.put(f"{run_id}/{name}/x/c/0", b"\0" * 100)
    rec = {"status": status, "ended": time.time() - 10 if ended is None else ended, "keep_staged_for": keep}
    write_record(store, run_id, {**rec, "staged": [f"{run_id}/{name}" for name in staged]})


@pytest.mark.parametrize("where", ["local", "s3"])
def test_only_ended_runs_whose_time_is_up_lose_their_staged_data(where, tmp_path, request):
    if where == "s3":
        s3 = request.getfixturevalue("s3")
        store = vcdask.open_store(f"s3://{s3.new_bucket()}/runs", **s3.options())
    else:
        store = vcdask.open_store(tmp_path / "store")
    _ended(store, "run-done")
    _ended(store, "run-stopped", status="stopped", staged=("train.zarr", "validation.zarr"))
    _ended(store, "run-running", status="running")
    _ended(store, "run-incomplete", status="incomplete")  # (its scheduler went: resume is there to continue it)
    _ended(store, "run-recent", keep=3600.0)
    _ended(store, "run-kept", keep=None)  # retention=False
    store.files.put("run-old/train.zarr/zarr.json", b"{}")  # a run of a vcdask before this: no paths, no time
    write_record(store, "run-old", {"status": "finished", "ended": 1.0})
    store.files.put("run-unread/status.json", b'{"status": "fini')  # cut short
    store.files.put("run-unread/train.zarr/zarr.json", b"{}")

    assert sweep_staged(store.files, dry_run=True) == {"run-done": 102, "run-stopped": 204}
    assert store.files.nbytes("run-done/train.zarr") == 102
    assert sweep_staged(store.files) == {"run-done": 102, "run-stopped": 204}
    for run in ("run-done", "run-stopped"):
        assert store.files.nbytes(f"{run}/train.zarr") is None and store.files.exists(f"{run}/status.json")
        with pytest.raises(FileNotFoundError, match=rf"run '{run}' cannot be resumed.*its own Retention"):
            check_staged(store.files, run)
    for run in ("run-running", "run-incomplete", "run-recent", "run-kept", "run-old", "run-unread"):
        assert store.files.nbytes(f"{run}/train.zarr"), run
        check_staged(store.files, run)
    assert sweep_staged(store.files) == {}  # removed once
    # a run that recorded no time of its own goes by the collection's (a run recorded None keeps its data)
    assert sweep_staged(store.files, default=0.0) == {"run-old": 2}
    # an override, for every run, whatever it recorded (vcdask gc --keep-staged-days); only ended runs still
    assert sweep_staged(store.files, override=0.0) == {"run-recent": 102, "run-kept": 102}
    assert sweep_staged(store.files, ["run-running", "run-incomplete"], override=0.0) == {}
    with pytest.raises(FileNotFoundError, match=r"run 'run-kept' cannot be resumed.*\(a collection, keep_staged_for"):
        check_staged(store.files, "run-kept")


def test_a_run_resumed_while_its_data_is_collected_keeps_it(tmp_path):
    """The sweep writes its marker, then reads the run's record again: a resume that started meanwhile (its
    record says running again) keeps the data, and the marker goes."""
    store = vcdask.open_store(tmp_path / "store")
    _ended(store, "run-a")

    class Resumed:  # the store's side files, as a resume writing the run's record between two reads sees them
        def __init__(self, files):
            self.files, self.reads = files, 0

        def __getattr__(self, name):
            return getattr(self.files, name)

        def get(self, path):
            if path == "run-a/status.json":
                self.reads += 1
                if self.reads == 1:  # (the sweep's second read: the first came through get_many)
                    write_record(store, "run-a", {"status": "running", "staged": ["run-a/train.zarr"]})
            return self.files.get(path)

    assert sweep_staged(Resumed(store.files)) == {}
    assert store.files.nbytes("run-a/train.zarr") == 102 and not store.files.exists(f"run-a/{GONE}")
