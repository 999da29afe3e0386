"""A store that many runs wrote into: what one collection, one branch's versions and ``vcdask runs`` ask of
Icechunk does not grow with the number of runs.

Each run leaves its branch and a hidden pin (``vcdask.keep.<version>.<run>``) per version its retention keeps: a
store of 300 runs held 1800 Icechunk branches, and every ``versions(run)`` listed them all (about 0.1 ms per
branch on a local disk) and parsed every name; a collection of every branch called it for each branch (300 runs:
303 listings, 30 of its 36 s), ``vcdask runs`` too, and a run's own collection looked up every pin.  These tests
count the calls that a real store makes of Icechunk's own ``Repository`` (a spy that calls through) in a store
of a few runs, and again once more runs are there; and check that what a collection keeps and removes is what
it was.  Timings are in ``benchmarks/many_runs.py``.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections import Counter

import icechunk
import pytest
import torch

import vcdask
from vcdask import Retention
from vcdask.cli import main as cli
from vcdask.store._history import pin_name

#: Icechunk's calls whose number a store with more runs must not grow.
COUNTED = ("list_branches", "list_tags", "lookup_branch", "lookup_snapshot")
POLICY = Retention(keep_last=2, keep_epochs=False, grace=0)


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Icechunk's :data:`COUNTED` calls, by name (and ``lookup_branch:<branch>``), on every repository."""
    seen: Counter = Counter()
    for name in COUNTED:
        real = getattr(icechunk.Repository, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            seen[_name] += 1
            if _name == "lookup_branch":
                seen[f"lookup_branch:{args[0] if args else kwargs.get('branch')}"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(icechunk.Repository, name, spy)
    return seen


def _counted(calls: Counter, fn) -> tuple[Counter, object]:
    """The calls ``fn()`` makes, and what it returns."""
    calls.clear()
    out = fn()
    counted = Counter(calls)
    calls.clear()
    return counted, out


def _commit(store, branch: str, steps, keep_from=None) -> dict[int, str]:
    out = {}
    for step in steps:
        meta = {"run_id": branch, "step": step, "epoch": step // 3}
        mark = step if keep_from is None else keep_from
        out[step] = store.commit({"w": torch.full((4,), float(step))}, meta, branch=branch, keep_from=mark)
    return out


def _ended_run(store, run: str) -> dict[int, str]:
    """A run as the engine leaves it: five versions, its writer's marker, its own final collection (which pins
    what it keeps), a spec and an ended run's record."""
    store.create_branch(run)
    versions = _commit(store, run, range(5))
    store.gc(Retention(), branches=[run], in_use={run: 4})
    store.files.put(f"{run}/spec.pkl", b"")
    store.files.put(f"{run}/status.json", b'{"status": "finished", "stop_kind": "max_epochs", "epochs_done": 2}')
    return versions


def _more_runs(store, count: int, start: int) -> None:
    for i in range(start, start + count):
        _ended_run(store, f"run-20260101-0000{i:02d}-filler")


def _ids(versions: dict[int, str], steps) -> set[str]:
    return {versions[s] for s in steps}


def test_a_collection_of_every_branch_lists_the_branches_once_and_looks_up_no_pin(tmp_path, calls):
    """Several runs, a branch made from another's version, a tag, a reader's hold: the same versions kept and
    removed as ever, with one listing of the branches (before: one per branch) and no look-up of any pin."""
    store = vcdask.open_store(tmp_path / "s")
    _more_runs(store, 2, 0)
    store.create_branch("run-a")
    a = _commit(store, "run-a", range(8))
    store.create_branch("run-b", a[2])  # (a resumed run: run-a's first versions are in its history)
    b = _commit(store, "run-b", range(10, 13))
    store.tag("best", a[1])
    with store.hold(a[3]):
        counted, report = _counted(calls, lambda: store.gc(POLICY))
    assert set(report.kept["run-a"]) == _ids(a, (1, 6, 7))  # the newest two, and the tagged one
    assert set(report.removed["run-a"]) == _ids(a, (0, 2, 4, 5)) and report.deferred["run-a"] == [a[3]]  # held
    assert set(report.kept["run-b"]) == _ids(b, (11, 12)) | {a[1]}
    assert set(report.removed["run-b"]) == _ids(b, (10,)) | _ids(a, (0, 2)) and report.deferred["run-b"] == []
    assert report.held_back == []
    assert [v.id for v in store.versions("run-a")] == [a[7], a[6], a[1]]  # (a[3]: out of its history, still held)
    assert [v.id for v in store.versions("run-b")] == [b[12], b[11], a[1]]
    assert store.read(a[3]).metadata["step"] == 3 and store.read(tag="best").metadata["step"] == 1
    assert counted["list_branches"] <= 2, counted  # (2: it removed versions, and read the holds again first)
    assert not [k for k in counted if k.startswith("lookup_branch:vcdask.")], counted
    # nothing to remove (once the released hold's pin is gone): one listing, and no more look-ups with more runs
    store.gc(POLICY)
    few, _ = _counted(calls, lambda: store.gc(POLICY))
    _more_runs(store, 6, 2)
    store.gc(POLICY)  # (the new runs' versions this policy does not keep)
    many, again = _counted(calls, lambda: store.gc(POLICY))
    assert few["list_branches"] == many["list_branches"] == 1, (few, many)
    assert few["lookup_branch"] == many["lookup_branch"] and few["list_tags"] == many["list_tags"], (few, many)
    assert again.n_removed == 0 and set(again.kept["run-a"]) == _ids(a, (1, 6, 7))


def test_a_runs_own_collection_looks_up_each_other_branch_once_and_no_pin(tmp_path, calls):
    """A run's own collection (``in_use``: as the engine collects) still keeps what a running run elsewhere
    needs (its marker's versions: the cutoff stops there), with one listing and one look-up of each other
    run's branch: not of its pins, not twice, and no snapshot read again while that branch stays as it was."""
    store = vcdask.open_store(tmp_path / "s")
    _more_runs(store, 2, 0)
    store.create_branch("run-c")
    early = _commit(store, "run-c", range(4))
    store.create_branch("run-d")  # running elsewhere: its writer needs its versions from step 2 on
    d = _commit(store, "run-d", range(5), keep_from=2)
    late = _commit(store, "run-c", range(4, 8))
    own = {"run-c": 7}
    counted, report = _counted(calls, lambda: store.gc(POLICY, branches=["run-c"], in_use=own))
    assert set(report.kept["run-c"]) == _ids(late, (6, 7))
    assert set(report.removed["run-c"]) == _ids(early, range(4))  # written before run-d's step 2: gone
    assert set(report.deferred["run-c"]) == _ids(late, (4, 5))  # after it: the cutoff is there
    assert [v.id for v in store.versions("run-d")] == [d[4], d[3], d[2]]  # (the older ones it no longer needs)
    assert not [k for k in counted if k.startswith("lookup_branch:vcdask.")], counted
    assert counted["list_branches"] <= 2, counted
    others = {"main", "run-d", "run-20260101-000000-filler", "run-20260101-000001-filler"}
    assert all(counted[f"lookup_branch:{b}"] <= 1 for b in others), counted
    # again, with nothing to remove: once more runs are there, one more look-up for each, nothing else more
    few, _ = _counted(calls, lambda: store.gc(POLICY, branches=["run-c"], in_use=own))
    _more_runs(store, 5, 2)
    store.gc(POLICY, branches=["run-c"], in_use=own)  # (the new runs' heads: read once)
    many, again = _counted(calls, lambda: store.gc(POLICY, branches=["run-c"], in_use=own))
    assert few["list_branches"] == many["list_branches"] == 1, (few, many)
    assert many["lookup_branch"] - few["lookup_branch"] == 5 and many["lookup_snapshot"] == few["lookup_snapshot"]
    assert set(again.kept["run-c"]) == _ids(late, (6, 7)) and set(again.deferred["run-c"]) == _ids(late, (4, 5))


def test_one_branchs_versions_do_not_list_every_other_runs_branches(tmp_path, calls):
    """A branch's versions, its pinned ones too, with no listing of the branches on a local disk (the folders
    under ``refs/`` name its pins, each looked up); the folder a deleted pin leaves is no version of it."""
    store = vcdask.open_store(tmp_path / "s")
    run = "run-20260101-000000-mine"
    v = _ended_run(store, run)
    store.commit({"w": torch.zeros(4)}, {"step": 5, "epoch": 2}, branch=run, keep_from=5)
    store.gc(POLICY, branches=[run], in_use={run: 5})  # v[4] and the new head kept; v[0..3] unpinned, gone
    expected = [x.id for x in store.versions(run)]
    assert len(expected) == 2 and expected[1] == v[4]
    gone = os.path.join(store.location, "refs", f"branch.{pin_name(v[0], run)}")
    os.makedirs(gone, exist_ok=True)  # (a pin deleted by a collection that stopped before removing its folder)
    few, listed = _counted(calls, lambda: store.versions(run))
    assert [x.id for x in listed] == expected
    _more_runs(store, 6, 1)
    os.makedirs(gone, exist_ok=True)  # (their collections removed it)
    many, listed = _counted(calls, lambda: store.versions(run))
    assert [x.id for x in listed] == expected
    assert few["list_branches"] == many["list_branches"] == 0, (few, many)
    assert few == many, (few, many)  # (its own two pins and the empty folder looked up: nothing of the others)


def test_vcdask_runs_lists_the_branches_once_whatever_the_number_of_runs(tmp_path, calls):
    location = str(tmp_path / "s")
    store = vcdask.open_store(location)
    _more_runs(store, 2, 0)

    def listing() -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli(["runs", location]) == 0
        return out.getvalue()

    few, shown = _counted(calls, listing)
    assert "2 runs in" in shown and shown.count("finished") == 2
    _more_runs(store, 6, 2)
    many, shown = _counted(calls, listing)
    assert "8 runs in" in shown and shown.count("finished") == 8 and " 2/" in shown
    assert few["list_branches"] == many["list_branches"] == 1, (few, many)
    assert few["lookup_branch"] == many["lookup_branch"] <= 1, (few, many)  # (opening the store: "main")


def test_a_pin_removed_after_a_collection_listed_it_is_left_out_not_a_missing_branch(tmp_path):
    """A scheduled ``gc`` lists the refs; meanwhile the run's own collection unpins two versions and deletes
    them.  Reading the branch with the pins listed before left the versions' look-up failing, said as "no branch
    'run-c'" of a branch that exists; the versions gone are left out."""
    from vcdask.store._collect import pin_index
    from vcdask.store._history import read_branch

    store = vcdask.open_store(str(tmp_path / "s"))
    store.create_branch("run-c")
    _commit(store, "run-c", range(6))
    policy = Retention(keep_last=2, keep_epochs=False)
    store.gc(policy, branches=["run-c"], in_use={"run-c": 3})  # (pins what step 3 on needs)
    _commit(store, "run-c", [6])
    cron = vcdask.open_store(str(tmp_path / "s"))  # (a scheduled gc's process)
    listed = pin_index(cron._repo.reopen().list_branches()).get("run-c", {})  # its listing
    assert len(listed) == 3
    removed = store.gc(policy, branches=["run-c"], in_use={"run-c": 6}).removed["run-c"]  # the run's, meanwhile
    assert set(removed) <= set(listed) and removed
    _, versions = read_branch(cron, cron._repo.reopen(), "run-c", listed)
    assert {v.id for v in versions} == {v.id for v in store.versions("run-c")} and not set(removed) & {
        v.id for v in versions
    }


def test_a_commit_to_a_pin_or_a_hold_is_refused(tmp_path):
    """A collection takes a pin's version from its name (it never looks the pin up): a commit that moved a pin
    (``store.commit(..., branch="vcdask.keep.<v>.<b>")``, accepted before) would have let its version go."""
    store = vcdask.open_store(str(tmp_path / "s"))
    store.create_branch("run-c")
    _commit(store, "run-c", range(4))
    store.gc(Retention(keep_last=1, keep_epochs=False), branches=["run-c"], in_use={"run-c": 1})
    [pin] = [b for b in store._repo.list_branches() if b.startswith("vcdask.keep.")][:1]
    before = store._repo.lookup_branch(pin)
    for name in (pin, "vcdask.hold.X"):
        with pytest.raises(ValueError, match=r"'vcdask.keep.' or 'vcdask.hold.' belong to vcdask"):
            store.commit({"w": torch.zeros(4)}, {"step": 9}, branch=name)
    assert store._repo.lookup_branch(pin) == before
