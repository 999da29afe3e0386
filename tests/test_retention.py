"""Bounded storage: the retention policy, ParamStore.gc / hold, rule state only with the newest version,
resuming after a collection, and a fit of 200 merges that keeps at most epochs + K + tags versions.

Real Icechunk stores in temporary directories; the end-to-end tests use the session's LocalCluster.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from datetime import UTC, datetime, timedelta

import dask
import numpy as np
import pytest
import torch
import zarr

import vcdask
from vcdask import Retention
from vcdask.cli import main as cli
from vcdask.engine.params_server import ParamsServer
from vcdask.engine.progress import Progress
from vcdask.engine.recovery import read_back
from vcdask.errors import VersionNotFoundError
from vcdask.merge import Nesterov
from vcdask.params import FlatParams, flatten
from vcdask.store._retention import check_retention, select
from vcdask.updates import list_updates, read_update, update_path, write_update


def _params(step: int, n: int = 4096) -> FlatParams:
    g = torch.Generator().manual_seed(step)
    return flatten({"w": torch.randn(n, generator=g), "count": torch.tensor(step)})


def _commit_run(store, branch: str, merges: int, per_epoch: int) -> dict[int, tuple[str, FlatParams]]:
    """A run's versions as the engine writes them: step 0 is the initial version (epoch 0)."""
    store.create_branch(branch)
    out = {}
    for step in range(merges + 1):
        epoch = 0 if step == 0 else (step - 1) // per_epoch + 1
        params = _params(step)
        out[step] = (store.commit(params, {"run_id": branch, "step": step, "epoch": epoch}, branch=branch), params)
    return out


# -- the policy -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_last": 0}, r"keep_last=0.*integer >= 1"),
        ({"keep_last": 2.5}, r"keep_last=2.5"),
        ({"keep_last": True}, r"keep_last=True"),
        ({"every": 0}, r"every=0.*integer >= 1 or None"),
        ({"interval": -1}, r"interval=-1.*seconds >= 0"),
        ({"interval": float("nan")}, r"interval=nan"),
        ({"grace": "soon"}, r"grace='soon'.*or None"),
        ({"backlog_bytes": 0}, r"backlog_bytes=0.*integer >= 1 or None"),
        ({"backlog_bytes": 1.5e8}, r"backlog_bytes=150000000.0"),
    ],
)
def test_retention_names_the_bad_value_and_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Retention(**kwargs)


def test_retention_option_of_fit():
    assert check_retention(None) == Retention()
    assert check_retention(False) is None  # keep every version
    assert check_retention(Retention(keep_last=2)) == Retention(keep_last=2)
    with pytest.raises(TypeError, match=r"None \(the default policy\), False \(keep every version\)"):
        check_retention("all")
    with pytest.raises(TypeError, match="keep_epochs"):
        Retention(keep_epochs="yes")  # type: ignore[arg-type]
    import pickle

    assert pickle.loads(pickle.dumps(Retention(every=7))) == Retention(every=7)


def test_select_keeps_newest_epoch_ends_tags_every_and_in_use():
    start = datetime(2026, 1, 1, tzinfo=UTC)
    versions = [
        vcdask.VersionInfo(f"v{s}", None, start + timedelta(seconds=s), "", {"step": s, "epoch": (s + 3) // 4})
        for s in range(20, -1, -1)
    ]  # newest first; epochs end at steps 0, 4, 8, 12, 16, 20
    sel = select(versions, Retention(keep_last=3), tagged={"v5"})
    assert [v.metadata["step"] for v in sel.keep] == [20, 19, 18, 16, 12, 8, 5, 4, 0]
    assert len(sel.drop) == 21 - 9
    sel = select(versions, Retention(keep_last=1, keep_epochs=False, every=10), in_use_step=17)
    assert [v.metadata["step"] for v in sel.keep] == [20, 19, 18, 17, 10, 0]
    assert select([], Retention()).keep == []


# -- ParamStore.gc ----------------------------------------------------------------------------------
def test_gc_keeps_epochs_plus_k_plus_tags_and_every_kept_version_reads_back_bit_for_bit(tmp_path):
    store = vcdask.open_store(tmp_path / "s")
    run = _commit_run(store, "run-a", merges=200, per_epoch=20)  # 10 epochs
    store.tag("best", run[57][0])
    store.tag("final", run[200][0])
    before = store.store_nbytes()
    plan = store.gc(Retention(keep_last=5), dry_run=True)
    assert store.versions("run-a")[-1].id == run[0][0] and len(store.versions("run-a")) == 201  # nothing changed
    report = store.gc(Retention(keep_last=5))
    assert report.removed == plan.removed and report.kept == plan.kept
    kept = {v.metadata["step"]: v.id for v in store.versions("run-a")}
    assert sorted(kept) == [0, 20, 40, 57, 60, 80, 100, 120, 140, 160, 180, 196, 197, 198, 199, 200]
    assert len(kept) <= 10 + 5 + 2  # epochs + K + tags
    for step, version in kept.items():  # bit for bit what was committed
        assert version == run[step][0]
        assert store.read(version).params.equal(run[step][1])
    assert len(report.removed["run-a"]) == 201 - len(kept)
    for step in (1, 56, 195):
        with pytest.raises(VersionNotFoundError):
            store.read(run[step][0])
    assert report.objects_deleted > 0 and report.bytes_deleted > 100 * 4096 * 4
    assert store.store_nbytes() < before / 5
    assert store.branches() == {"main": None, "run-a": run[200][0]}  # the pins stay hidden
    again = store.gc(Retention(keep_last=5))
    assert again.n_removed == 0 and again.bytes_deleted == 0


def test_gc_never_takes_what_other_branches_or_running_tasks_need(tmp_path):
    store = vcdask.open_store(tmp_path / "s")
    old = _commit_run(store, "keeps-all", merges=10, per_epoch=10)  # no policy, and older than run-b
    run = _commit_run(store, "run-b", merges=30, per_epoch=30)
    report = store.gc(Retention(keep_last=2, keep_epochs=False), branches="run-b", in_use={"run-b": 25})
    assert report.removed == {"run-b": []} and len(report.deferred["run-b"]) == 25  # held back by keeps-all
    assert "'keeps-all' holds back expiry" in report.held_back[0] and "whole history" in report.held_back[0]
    assert [v.id for v in store.versions("keeps-all")] == [old[s][0] for s in range(10, -1, -1)]
    report = store.gc(Retention(keep_last=2, keep_epochs=False), branches=["run-b", "keeps-all"], in_use={"run-b": 25})
    assert {v.metadata["step"] for v in store.versions("run-b")} == {25, 26, 27, 28, 29, 30}  # in use: kept
    assert {v.metadata["step"] for v in store.versions("keeps-all")} == {9, 10}
    for step in range(25, 31):
        assert store.read(run[step][0]).params.equal(run[step][1])
    # a writer's marker (a running run elsewhere) keeps its versions from that step on
    store.create_branch("run-c")
    for step in range(12):
        store.commit(_params(step), {"step": step, "epoch": 1}, branch="run-c", keep_from=min(step, 7))
    store.gc(Retention(keep_last=1, keep_epochs=False), branches="run-b", in_use={"run-b": None})
    assert {v.metadata["step"] for v in store.versions("run-c")} == set(range(7, 12))
    with pytest.raises(VersionNotFoundError, match="no branch 'nope'.*run-b"):
        store.gc(branches="nope")
    with pytest.raises(TypeError, match="vcdask.Retention"):
        store.gc(5)  # type: ignore[arg-type]


def test_a_version_only_a_pin_this_collection_deletes_kept_is_reported_removed_or_kept_by_its_branch(tmp_path):
    """The pins of a collection (the versions it kept) and of released holds are not what keeps a version
    in the next one: a version dropped now is reported removed, as a dry run says beforehand; a version a
    branch without a policy starts from stays, whatever pin kept it before."""
    store = vcdask.open_store(tmp_path / "s")
    policy = Retention(keep_last=2, keep_epochs=False, grace=0)
    ids = [store.commit(_params(step), {"step": step, "epoch": 1}) for step in range(5)]
    assert store.gc(policy, branches="main").kept["main"] == [ids[4], ids[3]]  # pinned
    with store.hold(ids[4]):
        pass  # a hold pinned and released
    ids += [store.commit(_params(step), {"step": step, "epoch": 1}) for step in range(5, 8)]
    dry = store.gc(policy, branches="main", dry_run=True)
    assert set(dry.removed["main"]) == {ids[3], ids[4], ids[5]} and dry.deferred["main"] == []
    report = store.gc(policy, branches="main")
    assert report.removed == dry.removed and [v.id for v in store.versions("main")] == [ids[7], ids[6]]
    for gone in dry.removed["main"]:
        with pytest.raises(VersionNotFoundError):
            store.read(gone)
    # a branch from a version the policy keeps now: once the policy drops it, the branch keeps it
    store.create_branch("exp", ids[6])
    store.commit(_params(100), {"step": 100}, branch="exp")
    ids += [store.commit(_params(step), {"step": step, "epoch": 1}) for step in range(8, 10)]
    report = store.gc(policy, branches="main")
    assert ids[6] not in report.removed["main"] and "'exp' holds back expiry" in report.held_back[0]
    assert [v.metadata["step"] for v in store.versions("exp")] == [100, 6]
    assert store.read(ids[6]).params.equal(_params(6))


def test_only_the_newest_version_keeps_the_rule_state(tmp_path):
    store = vcdask.open_store(tmp_path / "s")
    store.create_branch("run-s")
    states = [{"momentum": _params(100 + i)} for i in range(3)]
    ids = [store.commit(_params(i), {"step": i}, branch="run-s", state=states[i]) for i in range(3)]
    assert store.read_state(ids[2])["momentum"].equal(states[2]["momentum"])
    with pytest.raises(VersionNotFoundError, match="no longer kept"):
        store.read_state(ids[1])
    assert len(store.files.list("run-s/rule-state")) == 1
    assert store.read(ids[1]).params.equal(_params(1))  # its parameters stay
    # a version written by an earlier vcdask, with the state inside it, still gives it back
    from vcdask.store._layout import FORMAT, FORMAT_KEY, write_flat, write_state

    session = store._repo.writable_session("run-s")
    write_flat(session.store, _params(9), store.chunk_bytes)
    write_state(session.store, states[0], store.chunk_bytes)
    legacy = session.commit("written by vcdask 0.1", metadata={FORMAT_KEY: FORMAT, "step": 9})
    assert store.read_state(legacy)["momentum"].equal(states[0]["momentum"])
    newer = store.commit(_params(10), {"step": 10}, branch="run-s")
    assert "rule" not in zarr.open_group(store._repo.readonly_session(snapshot_id=newer).store, mode="r")


def _state_writer(location: str, commits: int, conn) -> None:
    """Commit versions with rule state on ``run-w``; send back the versions whose state was gone at once."""
    store = vcdask.open_store(location)
    lost = []
    for i in range(commits):
        version = store.commit(_params(i, 256), {"step": i}, branch="run-w", state={"momentum": _params(1000 + i, 256)})
        try:
            store.read_state(version)  # (nobody else commits here: the version is still the branch's head)
        except VersionNotFoundError as e:
            lost.append(f"commit {i}: {e}")
    conn.send(lost)


def test_a_collection_in_another_process_never_takes_the_state_of_a_commit_in_progress(tmp_path):
    """``vcdask gc`` sweeps an idle branch's rule state; a writer that resumes on that branch meanwhile
    writes its state object first and commits after, and the sweep must not take that object."""
    location = str(tmp_path / "s")
    store = vcdask.open_store(location)
    store.create_branch("run-w")
    store.commit(_params(0, 256), {"step": 0}, branch="run-w", state={"momentum": _params(999, 256)})
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    writer = ctx.Process(target=_state_writer, args=(location, 40, child))
    collections = 0
    with dask.config.set({"vcdask.store.idle-after": 0}):  # every branch counts as idle: anyone sweeps it
        writer.start()
        child.close()
        try:
            while writer.is_alive() and not parent.poll():
                store.gc(Retention(keep_last=1))
                collections += 1
            assert parent.poll(60), f"the writer died (exit code {writer.exitcode})"
            lost = parent.recv()
        finally:
            writer.join(30)
            if writer.is_alive():
                writer.terminate()
        assert collections > 5 and lost == []
        (stray,) = store.files.list("run-w/rule-state")  # (the writer deleted what its own commits replaced)
        store.files.put(stray.replace(".safetensors", "-left.safetensors"), b"a failed commit's leftover")
        store.gc(Retention(keep_last=1))  # an idle branch: what no version names goes, what the head names stays
    head = store.versions("run-w")[0]
    assert store.read_state(head.id)["momentum"].equal(_params(1039, 256))
    assert len(store.files.list("run-w/rule-state")) == 1


# -- a reader in another process, while a collection runs --------------------------------------------
def _reader(location: str, held: str, unheld: str, conn) -> None:
    """Open both versions (plain zarr on Icechunk sessions), read half, hold ``held`` only; read the rest
    after the other process collected."""
    store = vcdask.open_store(location, mode="r+")
    out = {}
    with store.hold(held):
        arrays = {}
        for name, version in (("held", held), ("unheld", unheld)):
            session = store._repo.readonly_session(snapshot_id=version)
            arrays[name] = zarr.open_group(session.store, mode="r", path="params")["float32"]
            out[f"{name}_first"] = arrays[name][:2048].copy()
        conn.send("ready")
        assert conn.recv() == "collected"
        for name, arr in arrays.items():
            try:
                out[name] = np.concatenate([out[f"{name}_first"], arr[2048:]])
            except Exception as e:  # noqa: BLE001 - what the unheld reader gets is the point
                out[name] = f"{type(e).__name__}: {e}"
    conn.send(out)


def test_a_reader_holding_an_old_version_still_reads_it_while_gc_runs(tmp_path):
    store = vcdask.open_store(tmp_path / "s")
    run = _commit_run(store, "run-r", merges=30, per_epoch=30)
    held, unheld = run[3][0], run[4][0]
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    reader = ctx.Process(target=_reader, args=(str(tmp_path / "s"), held, unheld, theirs))
    reader.start()
    try:
        assert mine.poll(120) and mine.recv() == "ready"
        report = store.gc(Retention(keep_last=2, keep_epochs=False))
        mine.send("collected")
        assert mine.poll(60)
        out = mine.recv()
    finally:
        reader.join(30)
    assert held in report.deferred["run-r"] and unheld in report.removed["run-r"]
    want = run[3][1].arrays["float32"].numpy()
    assert isinstance(out["held"], np.ndarray) and np.array_equal(out["held"], want)  # bit for bit
    assert isinstance(out["unheld"], str), "a version nobody held was still readable: the test proves nothing"
    # the hold is gone with its reader: the next collection takes the version, and a new hold says so
    store.gc(Retention(keep_last=2, keep_epochs=False))
    with pytest.raises(VersionNotFoundError):
        store.read(held)
    with pytest.raises(VersionNotFoundError, match="gone or being collected"):
        with store.hold(unheld):
            pass


def test_a_version_whose_parent_a_collection_just_removed_reads_with_no_parent(tmp_path):
    """A collection rewrites the parent of the versions it keeps, then deletes the old snapshots: a read
    that looked its version up just before must still read it (a validation once failed on that race),
    with no parent, as it reads once the collection is over."""
    store = vcdask.open_store(tmp_path / "s")
    run = _commit_run(store, "run-p", merges=3, per_epoch=3)
    (tmp_path / "s" / "snapshots" / run[2][0]).unlink()  # the collection's delete, after the read's look-up
    reader = vcdask.open_store(tmp_path / "s")  # a worker's store, nothing cached
    got = reader.read(run[3][0])
    assert got.info.parent is None and got.info.id == run[3][0]
    assert np.array_equal(got.params.arrays["float32"].numpy(), run[3][1].arrays["float32"].numpy())
    assert reader.read(run[1][0]).info.parent == run[0][0]  # (a parent that is there is still named)


def test_a_store_kept_open_collects_after_another_collection_rewrote_and_removed_its_history(tmp_path):
    """A run's store stays open (and a resumed run's, read back from its spec, for the next run): it keeps
    the versions it read as they were read.  Another collection (the run before, another process) rewrites
    their parents and deletes the old ones; the next collection of this store walked its own copies into
    snapshots that are gone: "collecting old versions failed ... not found", at every collection."""
    writer = vcdask.open_store(tmp_path / "s")
    run = _commit_run(writer, "run-k", merges=8, per_epoch=4)
    resumed = vcdask.open_store(tmp_path / "s")
    assert resumed.read(run[8][0]).metadata["step"] == 8  # (a resumed run reads its branch's head)
    policy = Retention(keep_last=2, keep_epochs=False, grace=0)
    assert len(vcdask.open_store(tmp_path / "s").gc(policy, branches="run-k").removed["run-k"]) == 7  # steps 0-6
    for step in range(9, 12):  # the run goes on, and collects
        writer.commit(_params(step), {"run_id": "run-k", "step": step, "epoch": 3}, branch="run-k")
    report = resumed.gc(policy, branches="run-k")
    assert [resumed.read(v).metadata["step"] for v in report.kept["run-k"]] == [11, 10]
    assert [v.metadata["step"] for v in vcdask.open_store(tmp_path / "s").versions("run-k")] == [11, 10]


class _ListsAGhost:
    """A repository whose next branch listing still names a pin that another run's collection deletes right
    after (two runs collecting in one store): Icechunk's own repository, but for that one listing."""

    def __init__(self, repo, ghost: str | None) -> None:
        self._repo, self._ghost = repo, ghost

    def __getattr__(self, name):
        return getattr(self._repo, name)

    def reopen(self):  # (the collection's own look at the store)
        ghost, self._ghost = self._ghost, None
        return _Listing(self._repo.reopen(), ghost)


class _Listing(_ListsAGhost):
    def list_branches(self):
        ghost, self._ghost = self._ghost, None
        return {*self._repo.list_branches(), *([ghost] if ghost else [])}


def test_a_pin_deleted_between_the_listing_and_its_look_up_is_gone_not_an_error(tmp_path):
    """Another run's collection removed one of its pins meanwhile: the collection failed ("ref not found"),
    and at a run's end, where no later one comes, that run's retention was never applied."""
    store = vcdask.open_store(tmp_path / "s")
    _commit_run(store, "run-g", merges=6, per_epoch=3)
    store._repo = _ListsAGhost(store._repo, "vcdask.keep.0000000000000000GONE.run-other")
    report = store.gc(Retention(keep_last=2, keep_epochs=False, grace=0), branches="run-g")
    assert len(report.kept["run-g"]) == 2 and len(report.removed["run-g"]) == 5


# -- resume after a collection -----------------------------------------------------------------------
def _upload(store, run: str, epoch: int, shard: int, base_step: int) -> dict:
    path = update_path(run, epoch, shard, 0)
    write_update(store.files, path, _params(1000 * epoch + shard))
    return {"epoch": epoch, "shard": shard, "attempt": 0, "base_step": base_step, "update": path, "n_samples": 10}


def _server(store, run: str, retention) -> ParamsServer:
    if run not in store.branches():
        store.create_branch(run)
        store.commit(_params(0), {"run_id": run, "step": 0, "epoch": 0, "merged": []}, branch=run)
    server = ParamsServer(store, run, Nesterov(lr=0.7, momentum=0.9, delay=3), run, retention=retention)
    server.load()
    return server


def test_resume_after_gc_continues_exactly(tmp_path):
    """A server that collects as it goes dies; a new one resumes from what the store kept and gives
    exactly what a server that kept everything and never died gives."""
    shards = 4
    order = [(e, s) for e in (1, 2, 3) for s in range(shards)]
    keep_all = vcdask.open_store(tmp_path / "a")
    bounded = vcdask.open_store(tmp_path / "b")
    a = _server(keep_all, "run-x", None)
    b = _server(bounded, "run-x", Retention(keep_last=2, interval=0))
    for i, (epoch, shard) in enumerate(order[:7]):
        last = shard == shards - 1
        a.merge(_upload(keep_all, "run-x", epoch, shard, i), completes=last)
        b.merge(_upload(bounded, "run-x", epoch, shard, i), completes=last)
    kept = bounded.versions("run-x")
    assert [v.metadata["step"] for v in kept] == [7, 6, 4, 0]  # the newest 2, epoch 1's end, the initial version
    del b  # the server dies
    b2 = _server(bounded, "run-x", Retention(keep_last=2, interval=0))
    got = read_back(b2, bounded, "run-x", "run-x", shards)
    merged, ends, attempts, pending = got.merged, got.ends, got.attempts, got.pending
    assert merged == {1: {0, 1, 2, 3}, 2: {0, 1, 2}}  # although the versions that merged them are gone
    assert ends == {1: (4, kept[2].id)} and pending == ()
    assert attempts[(2, 2)] == 1
    assert b2.rule_state.scalars == a.rule_state.scalars
    for name in ("momentum", "pending"):
        assert b2.rule_state.arrays[name].equal(a.rule_state.arrays[name])
    for i, (epoch, shard) in enumerate(order[7:], start=7):
        last = shard == shards - 1
        a.merge(_upload(keep_all, "run-x", epoch, shard, i), completes=last)
        b2.merge(_upload(bounded, "run-x", epoch, shard, i), completes=last)
    assert b2.params.equal(a.params) and b2.step == a.step == 12
    assert bounded.read(b2.version).params.equal(keep_all.read(a.version).params)
    assert {v.metadata["step"] for v in bounded.versions("run-x")} == {0, 4, 8, 11, 12}
    assert b2.progress == a.progress == Progress(done=[[1, 4], [2, 8], [3, 12]])


def test_a_run_collects_once_its_backlog_of_versions_is_reached(tmp_path):
    """Long before ``interval``: at the commit that brings ``backlog_bytes`` of parameters, not before;
    with ``backlog_bytes=None`` only by ``interval``."""
    version_bytes = _params(0).nbytes
    for backlog in (3 * version_bytes, 3 * version_bytes - 1, None):
        store = vcdask.open_store(tmp_path / f"s{backlog}")
        policy = Retention(keep_last=1, keep_epochs=False, interval=3600, backlog_bytes=backlog)
        server = _server(store, "run-b", policy)
        counts = []
        for i in range(5):
            server.merge(_upload(store, "run-b", 1, i, i + 1), completes=False)
            counts.append((len(server.collect_seconds), len(store.versions("run-b"))))
        if backlog is None:
            assert counts == [(0, n) for n in (2, 3, 4, 5, 6)]  # the initial version and one per merge
        else:  # collected at the third merge: the newest version alone, then one more per merge
            assert counts == [(0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]


@pytest.mark.parametrize(
    ("since", "backlog", "last", "due"),
    [
        (10.0, 0, 0.0, True),  # the interval is up, backlog or not
        (0.1, 64 * 2**20, 0.0, True),  # the backlog is reached
        (0.1, 64 * 2**20 - 1, 0.0, False),  # one byte short
        (0.1, 2**40, 0.02, False),  # the last collection took 0.02 s: wait 0.2 s from its start
        (0.2, 2**40, 0.02, True),
        (9.9, 2**40, 5.0, False),  # a slow collection (an object store's listing): by the interval
    ],
)
def test_collection_due_takes_at_most_a_tenth_of_the_merge_thread(since, backlog, last, due):
    from vcdask.engine.committing import collection_due

    assert collection_due(Retention(), since, backlog, last) is due
    assert collection_due(Retention(backlog_bytes=None), since, backlog, last) is (since >= 10.0)


def test_runs_one_after_another_in_one_store_each_keep_their_policy(tmp_path, caplog):
    """A finished run pins what it keeps, so it never holds back the next run's collections; a run that
    keeps everything does (and the next run says so)."""
    caplog.set_level(logging.WARNING, logger="vcdask")  # whatever level earlier tests left the root logger at
    store = vcdask.open_store(tmp_path / "s")
    policy = Retention(keep_last=2, interval=0)
    kept = {}
    for run, retention in (("run-1", policy), ("run-2", policy), ("run-all", None), ("run-3", policy)):
        server = _server(store, run, retention)
        for i in range(8):
            server.merge(_upload(store, run, 1 + i // 4, i % 4, i), completes=i % 4 == 3)
        server.collect(final=True)
        kept[run] = [v.metadata["step"] for v in store.versions(run)]
    assert kept["run-1"] == kept["run-2"] == [8, 7, 4, 0] and len(kept["run-all"]) == 9
    assert [v.metadata["step"] for v in store.versions("run-1")] == [8, 7, 4, 0]  # still there
    assert len(kept["run-3"]) == 9  # held back by run-all (older, and it keeps everything) ...
    assert "'run-all' holds back expiry" in caplog.text  # ... and the run said why
    store.gc(policy, branches="run-all")
    store.gc(policy, branches="run-3")
    assert [v.metadata["step"] for v in store.versions("run-3")] == [8, 7, 4, 0]


# -- the command line -----------------------------------------------------------------------------
def test_cli_gc_and_versions_with_sizes(tmp_path, capsys):
    store = vcdask.open_store(tmp_path / "s")
    _commit_run(store, "run-a", merges=20, per_epoch=10)
    assert cli(["gc", str(tmp_path / "s"), "--keep-last", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "run-a: keeps 4 versions, would remove 17" in out and "main" not in out and "dry run: nothing changed" in out
    assert len(store.versions("run-a")) == 21
    assert cli(["gc", str(tmp_path / "s"), "--keep-last", "2", "--branch", "run-a"]) == 0
    assert "run-a: keeps 4 versions, removed 17" in capsys.readouterr().out
    assert cli(["versions", str(tmp_path / "s"), "--branch", "run-a"]) == 0
    out = capsys.readouterr().out
    assert out.count("16.0 KiB") == 4  # 4096 float32 parameters each (and an int64 counter)
    assert "4 versions on 'run-a'" in out and "the whole store holds" in out
    with pytest.raises(SystemExit) as usage:  # (a usage error, before the store is opened)
        cli(["gc", str(tmp_path / "s"), "--keep-last", "0"])
    assert usage.value.code == 2 and "--keep-last: must be an integer >= 1, got 0" in capsys.readouterr().err


# -- end to end: a fit of 200 merges ----------------------------------------------------------------
def _linear_data(n: int = 2000):
    g = np.random.default_rng(0)
    X = g.normal(size=(n, 8)).astype("float32")
    return X, (X[:, 0] + 0.5 * X[:, 1] > 0).astype("int64")


def _fit_in_thread(model, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=vcdask.fit(model, _linear_data(), **kwargs)))
    thread.start()
    return thread, out


def test_fit_of_200_merges_keeps_at_most_epochs_k_and_tags(client, tmp_path):
    """With alpha=0 each version is exactly the update it merged: every kept version must read back
    bit for bit as that update.  The run collects after every commit while its tasks read versions:
    none of them may fail.  A version tagged during the run (under a hold) is kept."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    initial = flatten(model)
    store = vcdask.open_store(tmp_path / "s")
    kwargs = dict(max_epochs=10, n_shards=20, batch_size=50, alpha=0.0, keep_updates=True, progress=False)
    fit, out = _fit_in_thread(model, client=client, store=store, retention=Retention(keep_last=3, interval=0), **kwargs)
    tagged = None
    deadline = time.monotonic() + 120
    while tagged is None and time.monotonic() < deadline and fit.is_alive():
        runs = [b for b in store.branches() if b.startswith("run-")]
        head = store.head(runs[0]) if runs else None
        if head is not None and store.read(head).metadata["step"] >= 30:
            try:
                with store.hold(head):
                    store.tag("mid-run", head)
                tagged = head
            except VersionNotFoundError:  # collected between the two calls: take the next one
                pass
        time.sleep(0.01)
    fit.join(180)
    result = out["result"]
    assert tagged is not None
    versions = result.store.versions(result.run_id)
    assert len(versions) <= 10 + 3 + 1  # epochs + K + tags
    steps = [v.metadata["step"] for v in versions]
    ends = [step for _, step in versions[0].metadata["progress"]["done"]]  # (epochs may overlap a little)
    # the newest 3 versions (a version may hold several merges: results queued together share a commit)
    assert steps[0] == 200 and steps[:3] == sorted(set(steps[:3]), reverse=True)
    assert {0, *ends} <= set(steps) and len(ends) == 10
    assert tagged in {v.id for v in versions}
    h = result.history
    assert (h.outcome == "merged").sum() == 200  # no task lost its version: a task that failed to read one is "lost"
    assert set(h[~h.accepted].outcome) <= {"late", "duplicate"}, h[~h.accepted].reason.tolist()  # (copies under load)
    by_version = {row.version_id: row.update for row in h.itertuples()}
    for v in versions:  # bit for bit: alpha=0 stores each merged update as it is
        want = initial if v.metadata["step"] == 0 else read_update(result.store.files, by_version[v.id])
        assert result.store.read(v.id).params.equal(want), v.metadata["step"]


def test_fit_stopped_then_resumed_after_collections(client, tmp_path):
    """The default rule (Nesterov, with momentum) and a tiny keep_last: the run stops midway with most
    of its versions gone, resumes from what is left, and merges every (epoch, shard) exactly once."""
    store = vcdask.open_store(tmp_path / "s")
    retention = Retention(keep_last=2, interval=0)
    kwargs = dict(max_epochs=4, n_shards=10, batch_size=50, client=client, store=store, progress=False)
    fit, out = _fit_in_thread(torch.nn.Linear(8, 2), retention=retention, **kwargs)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        runs = [b for b in store.branches() if b.startswith("run-")]
        if runs and store.head(runs[0]) and store.read(branch=runs[0]).metadata["step"] >= 15:
            vcdask.attach(runs[0], client).stop("the test stops it")
            break
        time.sleep(0.02)
    fit.join(120)
    first = out["result"]
    done = first.history[first.history.accepted]
    assert 15 <= len(done) < 40
    assert len(first.store.versions(first.run_id)) < len(done) - 5  # collections took most of them
    second = vcdask.resume(first.run_id, store=store, client=client, progress=False)
    more = second.history[second.history.accepted]
    pairs = [*zip(done.epoch, done.shard, strict=True), *zip(more.epoch, more.shard, strict=True)]
    assert sorted(pairs) == [(e, s) for e in range(1, 5) for s in range(10)]  # each exactly once
    final = second.store.read(second.version)
    assert final.metadata["step"] == 40
    progress = final.metadata["progress"]  # what a further resume would start from
    assert sorted(epoch for epoch, _ in progress["done"]) == [1, 2, 3, 4] and progress["open"] == []
    assert set(second.store.read_state(second.version)) == {"momentum", "pending"}
    assert len(second.store.versions(second.run_id)) <= 4 + 2 + 1


def test_versions_tasks_still_read_are_never_collected(client, tmp_path):
    """Keep only the newest version, collect after every commit, and validate every other merge: the
    validations read versions that are long superseded when they run; each must still be there."""
    X, y = _linear_data()
    retention = Retention(keep_last=1, keep_epochs=False, interval=0)
    # slow shards (many small batches): a validation waits for a slot while the other worker's merges go on
    kwargs = dict(max_epochs=4, n_shards=8, batch_size=2, local_epochs=2, validation=0.25, validate_every=1)
    kwargs["progress"] = False
    result = vcdask.fit(
        torch.nn.Linear(8, 2), (X, y), client=client, store=tmp_path / "s", retention=retention, **kwargs
    )
    assert result.history.accepted.sum() == 32
    assert [v.metadata["step"] for v in result.store.versions(result.run_id)] == [32]
    assert len(result.epochs) == 4 and result.epochs.loss.notna().all()


def test_a_torn_leftover_updates_attempt_is_not_used_again(tmp_path):
    """An upload cut short by a crash is not an update: its shard is trained again, and under the next
    attempt number (the same one would share its path with a worker that outlived the crash and finishes
    writing the old file over the new upload)."""
    from vcdask.updates import update_key

    store = vcdask.open_store(tmp_path / "s")
    server = _server(store, "run-t", None)
    path = _upload(store, "run-t", 1, 2, 0)["update"]
    whole = store.files.get(path)
    store.files.put(path, whole[: len(whole) // 2])  # (the upload the crash cut short)
    assert update_key(path) == (1, 2, 0) and update_key("run-t/notes.txt") is None
    got = read_back(server, store, "run-t", "run-t", 4)
    assert got.pending == () and got.merged == {} and got.attempts[(1, 2)] == 1
    assert list_updates(store.files, "run-t") == []  # (not an update: deleted)


def test_a_leftover_update_trained_from_a_draft_gets_the_version_that_committed_its_base(tmp_path):
    """A task that trained from a draft (its base merged, not yet committed) records its base by step only;
    the server kept such bases by step in memory, which the crash took. The version that committed that
    step is in the store: the resumed run reads the base from it (a rule that needs each update's base,
    ``"probe"``, turned the update down as unreadable, and with ``max_attempts=1`` the resumed run failed)."""
    store = vcdask.open_store(tmp_path / "s")
    server = _server(store, "run-d", None)
    for i in range(3):
        server.merge(_upload(store, "run-d", 1, i, i))
    path = update_path("run-d", 1, 3, 0)
    meta = {"epoch": 1, "shard": 3, "attempt": 0, "base_step": 2, "base_version": None, "update": path}
    write_update(store.files, path, _params(13), meta=meta)
    got = read_back(_server(store, "run-d", None), store, "run-d", "run-d", 4)
    [pending] = got.pending
    at_step_2 = next(v.id for v in store.versions("run-d") if v.metadata["step"] == 2)
    assert pending["base_step"] == 2 and pending["base_version"] == at_step_2


def test_a_resume_counts_its_target_and_patience_as_the_run_did(tmp_path):
    """A run extended after it ended counts from the epochs done; one whose scheduler died (its record says
    ``running``) goes on as its last session counted: an extended run that died counts from its extension."""
    from vcdask.engine.end import write_record

    store = vcdask.open_store(tmp_path / "s")
    server = _server(store, "run-c", None)
    for i in range(4):
        server.merge(_upload(store, "run-c", 1 + i // 2, i % 2, i), completes=i % 2 == 1)
    assert read_back(_server(store, "run-c", None), store, "run-c", "run-c", 2).resumed_at is None  # (no record)
    write_record(store, "run-c", {"status": "finished", "step": 4})
    assert read_back(_server(store, "run-c", None), store, "run-c", "run-c", 2).resumed_at is None  # (2: ends)
    write_record(store, "run-c", {"status": "running", "step": 4, "resumed_at": 1})
    assert read_back(_server(store, "run-c", None), store, "run-c", "run-c", 2).resumed_at == 1
