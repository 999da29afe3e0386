"""vcdask._safetensors and the objects written with it: updates and rule-state objects.

Checked against the safetensors library's own reader and writer, and against the ``.npz`` objects
that vcdask wrote before stop 33 (still read).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from vcdask import _npz
from vcdask import _safetensors as st
from vcdask.compress import encode
from vcdask.params import FlatParams, flatten
from vcdask.store import open_store
from vcdask.store._state import read_state_object, write_state_object
from vcdask.updates import read_update, read_update_meta, update_path, write_update

safetensors_torch = pytest.importorskip("safetensors.torch")

TENSORS = {
    "w": torch.randn(3, 4),
    "steps": torch.arange(5),  # int64: ordered first, by item size
    "mask": torch.tensor([True, False, True]),
    "half": torch.randn(7).bfloat16(),
    "b": torch.randn(2),
    "empty": torch.empty(0),
    "scalar": torch.tensor(3.0),
    "strided": torch.arange(20.0)[::2],  # not contiguous: stored contiguous
}


def _same(got, want) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def test_dump_parts_is_a_safetensors_file_that_the_library_reads():
    data = b"".join(st.dump_parts(TENSORS, {"vcdask.x": "1"}))
    _same(safetensors_torch.load(data), TENSORS)
    (n,) = np.frombuffer(data[:8], dtype="<u8")
    assert (8 + n) % 64 == 0  # the data starts 64-byte aligned
    f = st.read(bytearray(data))
    assert f.metadata == {"vcdask.x": "1"}
    for name, e in f.entries.items():  # each tensor aligned to its item size
        assert (f.start + e.begin) % TENSORS[name].element_size() == 0, name


def test_read_gives_writable_views_of_a_bytearray_and_copies_of_bytes():
    buf = bytearray(b"".join(st.dump_parts(TENSORS)))
    f = st.read(buf)
    _same({k: f.tensor(k) for k in f.entries}, TENSORS)
    f.tensor("w")[0, 0] = 42.0  # a view: the buffer changed, nothing was copied
    assert st.read(buf).tensor("w")[0, 0] == 42.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns about tensors over read-only memory: none here
        assert st.read(bytes(buf)).tensor("w")[0, 0] == 42.0


def test_read_reads_what_the_library_wrote():
    data = safetensors_torch.save({k: v.contiguous() for k, v in TENSORS.items()}, metadata={"k": "v"})
    f = st.read(bytearray(data))
    assert f.metadata == {"k": "v"}
    _same({k: f.tensor(k) for k in f.entries}, TENSORS)


def test_tensors_of_one_dtype_given_in_order_read_back_as_one_flat_view():
    parts = {"a": torch.arange(6.0).view(2, 3), "i": torch.arange(3, dtype=torch.int32), "b": torch.arange(6.0, 10.0)}
    buf = bytearray(b"".join(st.dump_parts(parts)))
    f = st.read(buf)
    flat = f.flat(["a", "b"], torch.float32)
    assert torch.equal(flat, torch.arange(10.0))
    flat[0] = -1.0  # one view of the buffer, no copy
    assert st.read(buf).tensor("a")[0, 0] == -1.0
    assert torch.equal(f.flat(["b", "a"], torch.float32), torch.cat([parts["b"], flat[:6]]))  # out of order: a copy
    with pytest.raises(ValueError, match="'i' is torch.int32, expected torch.float32"):
        f.flat(["a", "i"], torch.float32)


def test_bad_input_is_refused_with_the_reason():
    assert not st.is_safetensors(b"PK\x03\x04 a zip") and st.is_safetensors(b"\x10\x00")  # the latter: a torn one
    data = b"".join(st.dump_parts({"w": torch.randn(100), "b": torch.randn(3)}))
    with pytest.raises(ValueError, match="the tensors end at byte 412 of the data, which holds 404"):
        st.read(bytearray(data[:-8]))  # torn in its data
    with pytest.raises(ValueError, match="a header of .* bytes in 40 .torn, or not one"):
        st.read(bytearray(data[:40]))  # torn in its header
    with pytest.raises(ValueError, match="shorter than its header length"):
        st.read(b"\x01")
    with pytest.raises(ValueError, match="not a safetensors file: its header is not a JSON object"):
        st.read(b"\x02\x00\x00\x00\x00\x00\x00\x00[]")

    def header(entries: dict) -> bytes:
        text = json.dumps(entries).encode()
        return len(text).to_bytes(8, "little") + text

    with pytest.raises(ValueError, match="tensor 'b' starts at byte 8 of the data, expected 4"):  # a hole
        st.read(header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                        "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}) + bytes(12))  # fmt: skip
    with pytest.raises(ValueError, match=r"tensor 'a': dtype 'C64' is not one of \['BF16', 'BOOL'"):
        st.read(header({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}) + bytes(8))
    with pytest.raises(ValueError, match="tensor 'a': bytes 0:4 do not hold its shape .-1."):
        st.read(header({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}) + bytes(4))
    with pytest.raises(ValueError, match="not a safetensors file: TypeError"):
        st.read(header({"a": [1, 2]}))
    with pytest.raises(TypeError, match=r"tensor 'z': cannot store dtype torch.complex64; supported: .*torch.float32"):
        st.dump_parts({"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="may not be named '__metadata__'"):
        st.dump_parts({"__metadata__": torch.zeros(2)})


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    model[1].running_mean.add_(0.5)
    return model


def test_an_update_written_from_the_module_is_its_state_dict(tmp_path):
    """A CPU worker writes ``W_c`` straight from its model's tensors: the file reads back as the same
    FlatParams as the packed form gives, and the safetensors library reads it as the state dict."""
    store = open_store(tmp_path / "store")
    model = _model()
    from_module = update_path("r", 1, 0, 0)
    n = write_update(store.files, from_module, model, meta={"shard": 0})
    write_update(store.files, "r/updates/packed.safetensors", flatten(model))
    assert n == (tmp_path / "store" / "runs" / from_module).stat().st_size
    got, packed = read_update(store.files, from_module), read_update(store.files, "r/updates/packed.safetensors")
    assert isinstance(got, FlatParams) and got.layout == flatten(model).layout and got.equal(flatten(model))
    assert got.equal(packed)
    _same(safetensors_torch.load_file(tmp_path / "store" / "runs" / from_module), model.state_dict())
    assert read_update_meta(store.files, from_module) == {"shard": 0}


class _Mixed(torch.nn.Module):
    """Parameters and buffers of every stored dtype, those of equal item size interleaved."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(3, 2))
        self.register_buffer("count", torch.arange(4, dtype=torch.int32))
        self.b = torch.nn.Parameter(torch.randn(5))
        self.register_buffer("f16", torch.randn(6).half())
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("brain", torch.randn(2).bfloat16())
        self.register_buffer("steps", torch.tensor(7))
        self.register_buffer("none", torch.empty(0, 4))
        self.c = torch.nn.Parameter(torch.randn(2, 2, dtype=torch.float64))
        self.register_buffer("more", torch.arange(3, dtype=torch.int32))


def test_every_dtype_reads_back_as_flat_views_of_one_buffer(tmp_path):
    store = open_store(tmp_path / "store")
    model = _Mixed()
    write_update(store.files, "r/updates/m.safetensors", model)
    got = read_update(store.files, "r/updates/m.safetensors")
    assert got.layout == flatten(model).layout and got.equal(flatten(model))
    size = (tmp_path / "store" / "runs" / "r/updates/m.safetensors").stat().st_size
    starts = [a.data_ptr() for a in got.arrays.values() if a.numel()]
    assert len(got.arrays) == 7 and max(starts) - min(starts) < size  # views into one buffer, none copied
    assert all(a.data_ptr() % a.element_size() == 0 for a in got.arrays.values())


def test_a_layout_not_packed_in_order_reads_back_at_its_offsets(tmp_path):
    """Every layout vcdask makes packs its entries in order; one that does not still reads back right."""
    from vcdask.params import Entry, Layout

    store = open_store(tmp_path / "store")
    layout = Layout((Entry("a", (2,), "float32", 3), Entry("b", (3,), "float32", 0)))
    w = FlatParams(layout, {"float32": torch.arange(5.0)})
    write_update(store.files, "r/updates/x.safetensors", w)
    got = read_update(store.files, "r/updates/x.safetensors")
    assert torch.equal(got["a"], torch.tensor([3.0, 4.0])) and torch.equal(got["b"], torch.tensor([0.0, 1.0, 2.0]))
    assert got.equal(w)


def test_a_torn_or_foreign_update_is_rejected_by_the_merge_with_its_reason(tmp_path):
    from vcdask.engine.params_server import ParamsServer
    from vcdask.merge import VCASGD

    store = open_store(tmp_path / "s")
    store.create_branch("run")
    base = flatten(_model())
    store.commit(base, {"run_id": "run", "step": 0, "epoch": 0, "merged": []}, branch="run")
    server = ParamsServer(store, "run", VCASGD(alpha=0.5), "run")
    server.load()
    torn, foreign = update_path("run", 1, 0, 0), update_path("run", 1, 1, 0)
    write_update(store.files, torn, base)
    store.files.put(torn, store.files.get(torn)[:-100])
    store.files.put(foreign, safetensors_torch.save(dict(_model().state_dict())))  # no vcdask layout
    for shard, path, why in ((0, torn, "the tensors end at byte"), (1, foreign, "without a vcdask layout")):
        out = server.merge({"epoch": 1, "shard": shard, "attempt": 0, "base_step": 0, "update": path, "n_samples": 1})
        assert not out["accepted"] and out["reason"].startswith("unreadable update") and why in out["reason"]
    assert server.step == 0


def test_a_compressed_update_keeps_its_parts(tmp_path):
    store = open_store(tmp_path / "store")
    base = flatten(_model())
    w_c = flatten({k: v + 0.01 if v.is_floating_point() else v for k, v in base.items()})
    for codec in ("bf16", "int8"):
        enc = encode(codec, w_c, base, "v0", f"run-{codec}")
        write_update(store.files, f"r/updates/{codec}.safetensors", enc)
        back = read_update(store.files, f"r/updates/{codec}.safetensors")
        assert back.codec == codec and back.base_version == "v0"
        _same(back.parts, dict(enc.parts))


def test_updates_and_state_objects_of_earlier_releases_still_read(tmp_path):
    """Before stop 33 both were ``.npz`` files; a store keeps its state objects, and a resumed run
    finds an older run's leftover updates."""
    store = open_store(tmp_path / "store")
    w = flatten(_model())
    arrays = {d: a.numpy() for d, a in w.arrays.items()}
    arrays["__layout__"] = np.frombuffer(json.dumps(w.layout.to_dict()).encode(), dtype=np.uint8)
    arrays["__meta__"] = np.frombuffer(b'{"shard": 3}', dtype=np.uint8)
    store.files.put("r/updates/e00001-s00003-a000.npz", _npz.dumps(arrays))
    assert read_update(store.files, "r/updates/e00001-s00003-a000.npz").equal(w)
    assert read_update_meta(store.files, "r/updates/e00001-s00003-a000.npz") == {"shard": 3}

    m = flatten({"w": torch.randn(10)})
    layouts = {"momentum": m.layout.to_dict(), "pending": m.layout.to_dict()}
    old = {
        "momentum/float32": m.arrays["float32"].numpy(),
        "__layouts__": np.frombuffer(json.dumps(layouts).encode(), dtype=np.uint8),
        "__zeros__": np.frombuffer(b'["pending"]', dtype=np.uint8),
    }
    store.files.put("main/rule-state/old.npz", _npz.dumps(old))
    state = read_state_object(store.files, "main/rule-state/old.npz")
    assert torch.equal(state["momentum"].arrays["float32"], m.arrays["float32"])
    assert torch.equal(state["pending"].arrays["float32"], torch.zeros(10))
    path = write_state_object(store.files, "main", state, zeros={"pending"})
    assert path.endswith(".safetensors")
    again = read_state_object(store.files, path)
    assert torch.equal(again["momentum"].arrays["float32"], m.arrays["float32"]) and again["pending"].equal(
        state["pending"]
    )


def test_a_state_array_is_kept_as_zeros_only_when_every_value_is_zero(tmp_path):
    """The state writer stores an all-zero array as its layout alone; it looks at a thousand spread-out
    values first, so an array with one value set between them, or a ``-0.0``, must still be written."""
    store = open_store(tmp_path / "store")
    n = 100_003
    one = torch.zeros(n)
    one[n // 1024 * 7 + 3] = 1e-30  # between the sampled values
    negative = torch.zeros(n)
    negative[-1] = -0.0
    zeros = torch.zeros(n)
    state = {name: flatten({"w": t}) for name, t in (("one", one), ("negative", negative), ("zeros", zeros))}
    version = store.commit(flatten({"w": torch.ones(3)}), state=state)
    back = store.read_state(version)
    for name, t in (("one", one), ("negative", negative), ("zeros", zeros)):
        got = back[name].arrays["float32"]
        assert torch.equal(got.view(torch.int32), t.view(torch.int32)), name  # bit for bit: -0.0 stays -0.0
    (path,) = store.files.list("main/rule-state")
    assert len(store.files.get(path)) < 3 * n * 4  # two arrays written, the zeros as their layout
