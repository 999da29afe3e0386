"""vcdask._npz: the .npz bytes of updates and rule-state objects, without the copies."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from vcdask import _npz

ARRAYS = {
    "float32": np.arange(10, dtype=np.float32),
    "matrix": np.arange(12, dtype=np.float64).reshape(3, 4),
    "empty": np.array([], dtype=np.int64),
    "scalar": np.array(5, dtype=np.int16),
    "flags": np.array([True, False]),
    "__meta__": np.frombuffer(b'{"x": 1}', dtype=np.uint8),
    "strided": np.arange(20, dtype=np.float32)[::2],  # not contiguous: stored C-contiguous
}


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v), k


def test_dumps_is_a_plain_npz_that_numpy_and_zipfile_accept():
    data = _npz.dumps(ARRAYS)
    assert zipfile.ZipFile(io.BytesIO(data)).testzip() is None  # every member's CRC
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        _same({k: z[k] for k in z.files}, ARRAYS)


def test_loads_gives_aligned_writable_views_of_a_bytearray():
    buf = bytearray(_npz.dumps(ARRAYS))
    back = _npz.loads(buf)
    _same(back, ARRAYS)
    a = back["float32"]
    assert a.flags.writeable and a.ctypes.data % 64 == np.frombuffer(buf, np.uint8).ctypes.data % 64
    a[0] = 42.0  # a view: the buffer changed, nothing was copied
    assert _npz.loads(bytes(buf))["float32"][0] == 42.0
    assert not _npz.loads(bytes(buf))["float32"].flags.writeable  # bytes: read-only views


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_loads_reads_what_numpy_wrote(save):
    buf = io.BytesIO()
    save(buf, **ARRAYS)
    _same(_npz.loads(buf.getvalue()), {k: np.ascontiguousarray(v) if v.ndim else v for k, v in ARRAYS.items()})
