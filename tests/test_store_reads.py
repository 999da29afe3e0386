"""Reading versions: after a first read, a store asks for a version's metadata and chunks at once
(``store._flatread``); what it gets must be the version's own values whatever changed since."""

from __future__ import annotations

import icechunk
import numpy as np
import pytest
import torch
import zarr

from vcdask import open_store
from vcdask.store._flatread import read_flat


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(5003, generator=gen),  # 5003 float32: several chunks, the last one padded
        "h": torch.randn(3001, generator=gen).to(torch.bfloat16),
        "n": torch.tensor([seed, -seed, 2**40 + seed]),
        "b": torch.rand(9000, generator=gen) > 0.5,
    }


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


def test_every_version_reads_back_exactly_when_read_again_and_again(tmp_path):
    store = open_store(tmp_path / "s", chunk_bytes=4096)
    states = [_state(i) for i in range(4)]
    versions = [store.commit(s, {"step": i}) for i, s in enumerate(states)]
    reader = open_store(tmp_path / "s")  # a worker's own store object
    for _ in range(2):
        for version, want in zip(versions, states, strict=True):
            _equal(reader.read(version).state_dict(), want)
    _equal(reader.read(versions[0]).state_dict(), states[0])


def test_a_read_after_one_of_another_chunking_gets_its_own_chunks(tmp_path):
    """Two stores holding the same layout in chunks of different sizes, read in turn with one memory
    of the last read: each read gets the values of the version it reads."""
    a = open_store(tmp_path / "a", chunk_bytes=4096)
    b = open_store(tmp_path / "b", chunk_bytes=8192)
    va, vb = a.commit(_state(1)), b.commit(_state(2))
    repo_a = icechunk.Repository.open(icechunk.local_filesystem_storage(str(tmp_path / "a")))
    repo_b = icechunk.Repository.open(icechunk.local_filesystem_storage(str(tmp_path / "b")))
    seen: dict = {}
    for repo, version, seed in ((repo_a, va, 1), (repo_b, vb, 2), (repo_a, va, 1), (repo_b, vb, 2)):
        flat = read_flat(repo.readonly_session(snapshot_id=version).store, seen)
        want = {k: v.numpy() for k, v in _state(seed).items() if k != "h"}
        np.testing.assert_array_equal(flat.arrays["float32"].numpy(), want["w"])
        np.testing.assert_array_equal(flat.arrays["bool"].numpy(), want["b"])
        assert seen["params"].arrays[0].chunk == (1024 if repo is repo_a else 2048)


def test_a_chunk_a_version_does_not_hold_reads_as_the_fill_value(tmp_path):
    """Zarr leaves out chunks equal to the fill value (versions written by earlier vcdask releases
    may lack them): a read that asks for such a chunk gets zeros there."""
    store = open_store(tmp_path / "s", chunk_bytes=4096)
    want = _state(3)
    v1 = store.commit(want, {"step": 1})
    repo = icechunk.Repository.open(icechunk.local_filesystem_storage(str(tmp_path / "s")))
    session = repo.writable_session("main")
    arr = zarr.open_array(session.store, path="params/float32", mode="r+")
    arr[:1024] = 0  # with zarr's default write_empty_chunks=False: chunk 0 is removed
    earlier = {k: v for k, v in repo.lookup_snapshot(v1).metadata.items() if k != "vcdask:checksum"}  # (none then)
    v2 = session.commit("first chunk zeroed", metadata=earlier)
    assert not any(k == "params/float32/c/0" for k in zarr.core.sync.sync(_keys(repo, v2)))
    reader = open_store(tmp_path / "s")
    _equal(reader.read(v1).state_dict(), want)  # the first read: what the next one asks for
    zeroed = dict(want, w=torch.cat([torch.zeros(1024), want["w"][1024:]]))
    _equal(reader.read(v2).state_dict(), zeroed)
    _equal(reader.read(v1).state_dict(), want)


async def _keys(repo: icechunk.Repository, version: str) -> list[str]:
    store = repo.readonly_session(snapshot_id=version).store
    return [k async for k in store.list_prefix("params/float32/")]


def test_versions_of_an_empty_main_beside_run_branches_warns_with_the_newest_run(tmp_path):
    """Runs write their own branches: ``store.versions()`` on a store they wrote used to return [] without a
    word (the CLI lists the newest run instead)."""
    import warnings

    import vcdask

    store = vcdask.open_store(tmp_path / "s")
    assert store.versions() == []  # an empty store: nothing to point at
    store.create_branch("run-20260101-000000-aaaaaa")
    store.create_branch("run-20260102-000000-bbbbbb")
    with pytest.warns(UserWarning, match=r"newest 'run-20260102-000000-bbbbbb': store.versions\('run-2026"):
        assert store.versions() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.versions("main") == []  # asked for main by name: no warning


def test_a_chunk_overwritten_at_the_same_length_fails_to_load_naming_the_version(tmp_path):
    """Each version records its checksums when it is committed; a read compares them (issue 40): a chunk
    overwritten in storage with other bytes of the same length used to load, with changed parameters."""
    from vcdask.errors import StoreIntegrityError

    store = open_store(tmp_path / "s", chunk_bytes=4096)
    v1 = store.commit(_state(1), {"step": 1})
    run_reader = open_store(tmp_path / "s")
    run_reader.read(v1)  # it knows the layout now: its next reads copy and hash the chunks as they come
    chunks = tmp_path / "s" / "chunks"
    before = set(chunks.iterdir())
    v2 = store.commit(_state(2), {"step": 2})
    new = sorted(set(chunks.iterdir()) - before)
    assert new, "the second version wrote chunks of its own"
    victim = new[0]
    size = victim.stat().st_size
    victim.write_bytes(np.random.default_rng(0).bytes(size))  # same length, other bytes
    for reader in (open_store(tmp_path / "s"), run_reader):  # a first read (through Zarr), and a run's
        with pytest.raises(StoreIntegrityError, match=rf"version '{v2}' of local directory .*do not hold the bytes"):
            reader.read(v2)
        _equal(reader.read(v1).state_dict(), _state(1))  # the older version loads
    assert isinstance(StoreIntegrityError("x"), OSError)


def test_a_rule_state_object_changed_after_its_commit_fails_to_load(tmp_path):
    from vcdask.errors import StoreIntegrityError
    from vcdask.params import flatten

    store = open_store(tmp_path / "s")
    momentum = flatten({"w": torch.arange(4096, dtype=torch.float32)})
    v = store.commit(_state(1), state={"momentum": momentum})
    assert torch.equal(store.read_state(v)["momentum"].arrays["float32"], momentum.arrays["float32"])
    [path] = [p for p in (tmp_path / "s").rglob("*") if p.is_file() and "state" in str(p.relative_to(tmp_path / "s"))]
    data = bytearray(path.read_bytes())
    data[-8:] = b"\x00\x00\x80\x7f\x00\x00\x80\x7f"  # the last two floats become inf: same length
    path.write_bytes(bytes(data))
    with pytest.raises(StoreIntegrityError, match=rf"the merge rule's state 'momentum' of version '{v}'"):
        open_store(tmp_path / "s").read_state(v)


def test_checksums_fed_chunk_by_chunk_as_they_arrive_equal_those_of_the_whole():
    """A run's reads hash each chunk as it arrives (``_checksum.Hasher``), in whatever order the chunks
    come; the pieces' sums must be the ones a commit records for the whole arrays, odd tails included."""
    import random

    from vcdask.params import flatten
    from vcdask.store._checksum import Hasher, Pending
    from vcdask.store._layout import _to_numpy

    flat = flatten({"a": torch.randn(1001), "b": torch.randn(77).to(torch.bfloat16), "c": torch.arange(5)})
    piece = 1024
    hasher = Hasher(piece)
    for dtype, values in flat.arrays.items():
        data = _to_numpy(values, dtype)[0].view(np.uint8)
        spans = [(start, data[start : start + 904]) for start in range(0, len(data), 904)]  # 904: not a piece
        random.Random(0).shuffle(spans)
        for start, part in spans:
            hasher.add(dtype, start, part)
        hasher.finish(dtype)
    nbytes = {d: a.numel() * a.element_size() for d, a in flat.arrays.items()}
    assert hasher.result(flat.arrays, nbytes) == Pending(flat, piece).result()
    unaligned = Hasher(piece)
    unaligned.add("float32", 4, np.zeros(8, np.uint8))  # not on a word: verify hashes the read itself
    unaligned.finish("float32")
    assert unaligned.result(["float32"], {"float32": 12}) is None
