"""A conformance suite every parameter-store backend must pass.

Subclass :class:`StoreTests` and provide a ``store`` fixture returning a fresh,
empty store (as zarr's ``zarr.testing.store.StoreTests`` does for Zarr stores)::

    class TestMyBackend(StoreTests):
        @pytest.fixture
        def store(self, tmp_path):
            return vcdask.open_store(tmp_path / "store")
"""

from __future__ import annotations

import pickle

import pytest
import torch

from vcdask import open_store
from vcdask.errors import (
    BranchExistsError,
    ReadOnlyStoreError,
    StoreConflict,
    TagExistsError,
    VersionNotFoundError,
)
from vcdask.params import flatten, load_into

__all__ = ["StoreTests", "make_model", "trained_state"]


def make_model(seed: int = 0) -> torch.nn.Module:
    """A small CNN with conv, batchnorm and linear layers (float and integer state)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 6, 3, padding=1),
        torch.nn.BatchNorm2d(6),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(6 * 8 * 8, 10),
    )


def trained_state(seed: int = 0) -> torch.nn.Module:
    """``make_model`` after a few training-mode forward passes, so BatchNorm statistics are non-trivial."""
    model = make_model(seed)
    model.train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(16, 1, 8, 8, generator=g))
    return model


def _constant_state(value: float, n: int = 1000) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), float(value)), "step": torch.tensor(int(value))}


class StoreTests:
    """Behaviour every :class:`vcdask.ParamStore` must have."""

    @pytest.fixture
    def store(self):  # pragma: no cover - provided by subclasses
        raise NotImplementedError

    @pytest.fixture
    def store_options(self) -> dict:
        """Storage options needed to open ``store.location`` again (credentials, endpoint)."""
        return {}

    # -- round trips ----------------------------------------------------------------
    def test_round_trip_module_exact(self, store):
        model = trained_state(1)
        version = store.commit(model, {"epoch": 3, "note": "first"})
        fresh = make_model(2)
        store.read(version).load_into(fresh)
        original, loaded = model.state_dict(), fresh.state_dict()
        assert list(original) == list(loaded)
        for name, value in original.items():
            assert loaded[name].dtype == value.dtype, name
            assert torch.equal(loaded[name], value), name
        assert int(loaded["1.num_batches_tracked"]) == 3
        assert loaded["1.num_batches_tracked"].dtype == torch.int64

    def test_round_trip_mixed_dtypes(self, store):
        state = {
            "f64": torch.randn(3, 2, dtype=torch.float64),
            "f16": torch.randn(5).half(),
            "bf16": torch.randn(7).bfloat16(),
            "i32": torch.arange(4, dtype=torch.int32) - 2,
            "mask": torch.tensor([True, False, True]),
            "u8": torch.arange(250, 256, dtype=torch.uint8),
            "nan_inf": torch.tensor([float("nan"), float("inf"), -0.0]),
        }
        got = store.read(store.commit(state)).state_dict()
        assert list(got) == list(state)
        for name, value in state.items():
            assert got[name].dtype == value.dtype, name
            assert got[name].shape == value.shape, name
            assert torch.equal(
                got[name].view(-1).view(torch.uint8) if value.is_floating_point() else got[name],
                value.view(-1).view(torch.uint8) if value.is_floating_point() else value,
            ), name

    def test_empty_state(self, store):
        version = store.commit({})
        checkpoint = store.read(version)
        assert checkpoint.params.numel == 0
        assert checkpoint.state_dict() == {}

    # -- history ----------------------------------------------------------------------
    def test_history_newest_first_with_metadata(self, store):
        ids = [store.commit(_constant_state(i), {"step": i, "tags": ["a", i]}, message=f"m{i}") for i in range(3)]
        history = store.versions()
        assert [v.id for v in history] == ids[::-1]
        assert [v.metadata for v in history] == [{"step": i, "tags": ["a", i]} for i in (2, 1, 0)]
        assert [v.message for v in history] == ["m2", "m1", "m0"]
        assert [v.parent for v in history] == [ids[1], ids[0], None]
        assert history[0].written_at >= history[-1].written_at
        assert store.head() == ids[-1]

    def test_old_version_unchanged_by_newer_commits(self, store):
        ids = [store.commit(_constant_state(i)) for i in range(4)]
        for i, version in enumerate(ids):
            checkpoint = store.read(version)
            assert checkpoint.version == version
            assert torch.equal(checkpoint.state_dict()["w"], torch.full((1000,), float(i)))
        assert torch.equal(store.read().state_dict()["w"], torch.full((1000,), 3.0))

    def test_layout_change_between_versions(self, store):
        v1 = store.commit(_constant_state(1))
        v2 = store.commit({"other": torch.arange(6.0).reshape(2, 3)})
        assert store.read(v1).params.layout.names == ["w", "step"]
        assert store.read(v2).params.layout.names == ["other"]
        assert "int64" not in store.read(v2).params.arrays

    def test_commits_between_another_writers(self, store, store_options):
        """A writer's consecutive commits each read back, also when another writer (another store
        object on the same location) committed a different layout in between."""
        other = open_store(store.location, **store_options)
        v1 = store.commit(_constant_state(1))
        v2 = store.commit(_constant_state(2))  # on top of its own head
        v3 = other.commit({"other": torch.arange(6.0).reshape(2, 3)})  # someone else's head, new layout
        v4 = store.commit(_constant_state(4))  # not on its own head any more
        v5 = store.commit(_constant_state(5))
        for version, value in ((v1, 1), (v2, 2), (v4, 4), (v5, 5)):
            params = store.read(version).params
            assert params.layout.names == ["w", "step"]
            assert torch.equal(params.state_dict()["w"], torch.full((1000,), float(value)))
        assert other.read(v3).params.layout.names == ["other"]
        assert store.versions()[0].id == v5

    # -- tags ---------------------------------------------------------------------------
    def test_tags(self, store):
        v1 = store.commit(_constant_state(1))
        v2 = store.commit(_constant_state(2))
        store.tag("release-1", v1)
        assert store.tags() == {"release-1": v1}
        assert store.read(tag="release-1").version == v1
        assert torch.equal(store.read(tag="release-1").state_dict()["w"], torch.full((1000,), 1.0))
        with pytest.raises(TagExistsError, match="release-1"):
            store.tag("release-1", v2)
        with pytest.raises(VersionNotFoundError, match="nosuchtag"):
            store.read(tag="nosuchtag")
        with pytest.raises(VersionNotFoundError, match="AAAAAAAAAAAAAAAAAAAA"):
            store.tag("bad", "AAAAAAAAAAAAAAAAAAAA")

    # -- branches -----------------------------------------------------------------------
    def test_branches(self, store):
        base = store.commit(_constant_state(1))
        store.create_branch("run-a", base)
        run_v = store.commit(_constant_state(5), branch="run-a")
        assert store.head() == base  # main untouched
        assert store.head("run-a") == run_v
        assert [v.id for v in store.versions("run-a")] == [run_v, base]
        assert store.branches() == {"main": base, "run-a": run_v}
        assert torch.equal(store.read(branch="run-a").state_dict()["w"], torch.full((1000,), 5.0))
        with pytest.raises(BranchExistsError, match="run-a"):
            store.create_branch("run-a")

    def test_empty_branch(self, store):
        store.create_branch("fresh")
        assert store.head("fresh") is None
        assert store.versions("fresh") == []
        with pytest.raises(VersionNotFoundError, match="fresh"):
            store.read(branch="fresh")
        v = store.commit(_constant_state(7), branch="fresh")
        assert [x.id for x in store.versions("fresh")] == [v]

    def test_unknown_branch(self, store):
        with pytest.raises(VersionNotFoundError, match="nobranch") as info:
            store.commit(_constant_state(1), branch="nobranch")
        assert "main" in str(info.value)  # lists the branches that exist
        with pytest.raises(VersionNotFoundError, match="nobranch"):
            store.versions("nobranch")
        with pytest.raises(KeyError):
            store.read(branch="nobranch")

    def test_unknown_version(self, store):
        store.commit(_constant_state(1))
        with pytest.raises(VersionNotFoundError, match="AAAAAAAAAAAAAAAAAAAA"):
            store.read("AAAAAAAAAAAAAAAAAAAA")
        with pytest.raises(VersionNotFoundError, match="not-an-id"):
            store.read("not-an-id")

    # -- writers ------------------------------------------------------------------------
    def test_compare_and_swap(self, store):
        v1 = store.commit(_constant_state(1))
        v2 = store.commit(_constant_state(2), parent=v1)
        with pytest.raises(StoreConflict, match=v1):
            store.commit(_constant_state(3), parent=v1)
        assert [v.id for v in store.versions()] == [v2, v1]

    def test_metadata_checked(self, store):
        with pytest.raises(TypeError, match="JSON"):
            store.commit(_constant_state(1), {"bad": object()})
        with pytest.raises(ValueError, match="reserved"):
            store.commit(_constant_state(1), {"vcdask:format": 2})
        assert store.versions() == []

    def test_read_only(self, store, store_options):
        v = store.commit(_constant_state(1))
        ro = open_store(store.location, mode="r", **store_options)
        assert ro.read().version == v
        with pytest.raises(ReadOnlyStoreError, match="mode='r'"):
            ro.commit(_constant_state(2))
        with pytest.raises(PermissionError):
            ro.tag("x", v)
        assert store.versions()[0].id == v

    def test_pickle_reopens_same_store(self, store):
        v = store.commit(trained_state(3))
        clone = pickle.loads(pickle.dumps(store))
        assert clone.location == store.location
        assert clone.read().version == v
        assert clone.read(v).params.equal(flatten(trained_state(3)))

    def test_load_into_checks_model(self, store):
        v = store.commit(trained_state(0))
        wrong = torch.nn.Linear(3, 2)
        with pytest.raises(ValueError, match="weight"):
            store.read(v).load_into(wrong)
        right = load_into(make_model(5), store.read(v).params)
        assert torch.equal(right[0].weight, trained_state(0)[0].weight)

    # -- retention ------------------------------------------------------------------------
    def test_gc_keeps_what_the_policy_keeps(self, store):
        from vcdask import Retention

        store.create_branch("run")
        ids = [
            store.commit(_constant_state(s), {"step": s, "epoch": (s + 3) // 4}, branch="run") for s in range(12)
        ]  # epochs end at steps 0, 4, 8 and 11
        store.tag("keep-me", ids[2])
        report = store.gc(Retention(keep_last=2, grace=0), branches="run")
        kept = [v.id for v in store.versions("run")]
        assert kept == [ids[s] for s in (11, 10, 8, 4, 2, 0)]
        assert sorted(report.removed["run"]) == sorted(ids[s] for s in (1, 3, 5, 6, 7, 9))
        for s in (11, 10, 8, 4, 2, 0):  # bit for bit
            assert torch.equal(store.read(ids[s]).state_dict()["w"], torch.full((1000,), float(s)))
        with pytest.raises(VersionNotFoundError):
            store.read(ids[5])
        assert store.branches() == {"main": None, "run": ids[11]}

    def test_rule_state_only_with_the_newest_version(self, store):
        momentum = [flatten({"w": torch.full((10,), float(i))}) for i in range(2)]
        v0 = store.commit(_constant_state(0), state={"momentum": momentum[0]})
        v1 = store.commit(_constant_state(1), state={"momentum": momentum[1]})
        assert store.read_state(v1)["momentum"].equal(momentum[1])
        with pytest.raises(VersionNotFoundError, match="no longer kept"):
            store.read_state(v0)
        assert store.read_state(store.commit(_constant_state(2))) == {}

    def test_rule_state_rewrites_only_the_arrays_that_changed(self, store, store_options):
        """A commit writes the rule state arrays that changed since the writer's last commit (a zero
        array as its layout only) and names the objects of the others; every version reads back its
        own state exactly, also after another writer committed in between."""
        from vcdask import _safetensors
        from vcdask.store._state import state_folder

        def objects() -> int:
            return len(store.files.list(state_folder("main")))

        def names(version: str) -> dict[str, str]:  # the version's vcdask:state: each name's object
            return dict(store._repo.lookup_snapshot(version).metadata["vcdask:state"])

        def check(version: str, **expected: torch.Tensor) -> None:
            got = store.read_state(version)
            assert sorted(got) == sorted(expected)
            for name, values in expected.items():
                assert torch.equal(got[name].arrays["float32"], values), name

        m, p = flatten({"w": torch.randn(1000)}), flatten({"w": torch.randn(1000)})
        state = {"momentum": m, "pending": p}
        v1 = store.commit(_constant_state(1), state=state)
        assert objects() == 1
        check(v1, momentum=m.arrays["float32"], pending=p.arrays["float32"])
        p.arrays["float32"].add_(1.0)  # in place, as rules change their state
        v2 = store.commit(_constant_state(2), state=state)
        assert objects() == 2  # the first object still holds the unchanged momentum
        check(v2, momentum=m.arrays["float32"], pending=p.arrays["float32"])
        p.arrays["float32"].zero_()
        m.arrays["float32"].mul_(0.5)
        v3 = store.commit(_constant_state(3), state=state)
        assert objects() == 1  # both changed: one new object, the others gone
        check(v3, momentum=m.arrays["float32"], pending=torch.zeros(1000))
        (path,) = set(names(v3).values())
        stored = _safetensors.read(store.files.get_buffer(path)).entries
        assert "pending/float32" not in stored and "momentum/float32" in stored  # zeros: the layout only
        with pytest.raises(VersionNotFoundError, match="no longer kept"):
            store.read_state(v2)
        v4 = store.commit(_constant_state(4), state=state)  # nothing changed: no new object
        assert names(v4) == names(v3)
        check(v4, momentum=m.arrays["float32"], pending=torch.zeros(1000))
        m2 = flatten({"w": m.arrays["float32"].clone()})  # a new tensor, equal values: written again
        v5 = store.commit(_constant_state(5), state={"momentum": m2, "pending": p})
        assert names(v5)["momentum"] != names(v4)["momentum"] and names(v5)["pending"] == names(v4)["pending"]
        check(v5, momentum=m.arrays["float32"], pending=torch.zeros(1000))
        p.arrays["float32"][7] = -0.0  # a sign bit is not a zero
        v6 = store.commit(_constant_state(6), state={"momentum": m2, "pending": p})
        assert torch.signbit(store.read_state(v6)["pending"].arrays["float32"][7])
        other = open_store(store.location, **store_options)
        other.commit(_constant_state(7), state={"momentum": flatten({"w": torch.ones(1000)})})
        v8 = store.commit(_constant_state(8), state={"momentum": m2, "pending": p})  # not its head: all of it
        assert len(set(names(v8).values())) == 1
        check(v8, momentum=m.arrays["float32"], pending=p.arrays["float32"])
        assert objects() == 1

    def test_a_committed_version_never_changes(self, store):
        """The parameters and rule state a commit was given may change in place right after (a run's
        merge thread does that): the versions already committed read back as they were."""
        flat = flatten({"w": torch.randn(300_000), "n": torch.tensor([1, 2, 3])})
        momentum = flatten({"w": torch.randn(300_000)})
        expected = []
        for i in range(3):
            version = store.commit(flat, {"step": i}, state={"momentum": momentum})
            expected.append((version, flat.arrays["float32"].clone(), momentum.arrays["float32"].clone()))
            flat.arrays["float32"].add_(1.0)
            momentum.arrays["float32"].mul_(2.0)
        for version, params, _ in expected:
            assert torch.equal(store.read(version).params.arrays["float32"], params), version
        assert torch.equal(store.read_state(expected[-1][0])["momentum"].arrays["float32"], expected[-1][2])

    def test_a_collection_keeps_young_state_objects_of_an_idle_branch(self, store):
        """Any collection sweeps the rule state of an idle branch (``vcdask gc``); an object no version
        names may be another writer's commit in progress, so only those older than the grace go."""
        import time

        import dask

        from vcdask import Retention
        from vcdask.store._state import state_folder, write_state_object

        momentum = flatten({"w": torch.randn(100)})
        head = [store.commit(_constant_state(s), {"step": s}, state={"momentum": momentum}) for s in range(2)][-1]
        (kept,) = store.files.list(state_folder("main"))
        stray = write_state_object(store.files, "main", {"momentum": flatten({"w": torch.ones(100)})})
        with dask.config.set({"vcdask.store.idle-after": 0}):  # every branch counts as idle
            store.gc(Retention(keep_last=1, grace=3600))
            assert sorted(store.files.list(state_folder("main"))) == sorted([kept, stray])
            time.sleep(1.1)  # (object stores date objects to the second)
            store.gc(Retention(keep_last=1, grace=0))
        assert store.files.list(state_folder("main")) == [kept]
        assert store.read_state(head)["momentum"].equal(momentum)

    def test_hold_keeps_a_version_through_gc(self, store):
        from vcdask import Retention

        ids = [store.commit(_constant_state(s), {"step": s}) for s in range(6)]
        with store.hold(ids[1]):
            report = store.gc(Retention(keep_last=1, grace=0))
            assert ids[1] in report.deferred["main"] and ids[2] in report.removed["main"]
            assert torch.equal(store.read(ids[1]).state_dict()["w"], torch.full((1000,), 1.0))
        store.gc(Retention(keep_last=1, grace=0))
        with pytest.raises(VersionNotFoundError):
            store.read(ids[1])
        with pytest.raises(VersionNotFoundError, match="gone"):
            with store.hold(ids[2]):
                pass
