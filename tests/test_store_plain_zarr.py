"""A committed version reads the same with plain icechunk + zarr / xarray, without vcdask."""

from __future__ import annotations

import icechunk
import numpy as np
import pytest
import xarray as xr
import zarr

from vcdask import open_store
from vcdask.testing.store import trained_state


def _plain_tensors(session) -> dict[str, np.ndarray]:
    """What the docs tell users to do: read the layout, slice the flat array."""
    group = zarr.open_group(session.store, mode="r", path="params")
    flat = {name: arr[:] for name, arr in group.arrays()}
    out = {}
    for e in group.attrs["vcdask:layout"]["entries"]:
        start = e["offset"]
        out[e["name"]] = flat[e["dtype"]][start : start + int(np.prod(e["shape"]))].reshape(e["shape"])
    return out


def _check(repo: icechunk.Repository, store, version: str) -> None:
    expected = {k: v.numpy() for k, v in store.read(version).state_dict().items()}
    got = _plain_tensors(repo.readonly_session(snapshot_id=version))
    assert list(got) == list(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    ds = xr.open_zarr(repo.readonly_session(snapshot_id=version).store, group="params", consolidated=False)
    np.testing.assert_array_equal(ds["float32"].values, store.read(version).params.arrays["float32"].numpy())
    assert ds["int64"].values.tolist() == [3]
    assert ds.attrs["vcdask:layout"]["entries"][0]["name"] == "0.weight"


def test_plain_zarr_and_xarray_read_local(tmp_path):
    store = open_store(tmp_path / "s")
    v1 = store.commit(trained_state(1))
    store.commit(trained_state(2))
    repo = icechunk.Repository.open(icechunk.local_filesystem_storage(str(tmp_path / "s")))
    _check(repo, store, v1)
    # the history is plain Icechunk history too
    assert [s.id for s in repo.ancestry(branch="main")][:2] == [v.id for v in store.versions()]


@pytest.mark.s3
def test_plain_zarr_and_xarray_read_s3(s3):
    bucket = s3.new_bucket()
    store = open_store(f"s3://{bucket}/p", **s3.options())
    v1 = store.commit(trained_state(1))
    _check(icechunk.Repository.open(s3.icechunk_storage(bucket, "p")), store, v1)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_rewritten_versions_read_the_same_with_plain_zarr(tmp_path, where):
    """The store's own head is rewritten chunk by chunk (``_commit._put_chunks``): every version, with
    several chunks per array, a padded last chunk, and float32, bfloat16, float16, int64 and bool
    arrays, reads back exactly with plain zarr, and the versions before it are unchanged."""
    import torch

    store = open_store(tmp_path / "s" if where == "local" else "memory://", chunk_bytes=4096)
    gen = torch.Generator().manual_seed(0)

    def state(i: int) -> dict[str, torch.Tensor]:
        return {
            "w": torch.randn(5003, generator=gen),  # 5003 float32: 5 chunks of 1024, the last one padded
            "h": torch.randn(3001, generator=gen).to(torch.bfloat16),
            "f": torch.randn(2049, generator=gen).to(torch.float16),
            "n": torch.tensor([i, -i, 2**40 + i]),
            "b": torch.rand(9000, generator=gen) > 0.5,
        }

    states = [state(i) for i in range(4)]
    versions = [store.commit(s, {"step": i}) for i, s in enumerate(states)]
    for version, expected in zip(versions, states, strict=True):
        got = store.read(version).state_dict()
        for name, t in expected.items():
            assert torch.equal(got[name], t), (version, name)
        if where == "local":
            repo = icechunk.Repository.open(icechunk.local_filesystem_storage(str(tmp_path / "s")))
            plain = _plain_tensors(repo.readonly_session(snapshot_id=version))
            for name, t in expected.items():
                want = t.view(torch.uint16) if t.dtype == torch.bfloat16 else t
                np.testing.assert_array_equal(plain[name], want.numpy(), err_msg=name)
