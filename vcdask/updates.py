"""Client updates ``W_c`` in transit: one plain object per update in the store's run folder.

An update is a `safetensors <https://huggingface.co/docs/safetensors>`_ file
(``safetensors.torch.load_file`` reads it as a state dict): each tensor of ``W_c`` under its
``state_dict`` name, and in its metadata the layout (``vcdask.layout``) and a small JSON record
(``vcdask.meta``).  It is written in a single request by the worker that trained it, straight from
the model's tensors on a CPU worker, read once by the merge thread as views of one buffer, and
deleted once its merge is committed.  A compressed update (:mod:`vcdask.compress`) holds its encoded
parts (``"<dtype>.<part>"``) and the codec and base version (``vcdask.codec``) instead.  Updates
written before stop 33 are ``.npz`` files (:mod:`vcdask._npz`); they are still read.  This module is
the only place that writes, reads, lists or deletes updates.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Literal

import torch

from . import _npz
from . import _safetensors as st
from .compress import EncodedUpdate
from .params import FlatParams, Layout, state_tensors, torch_dtype

__all__ = [
    "delete_run_updates",
    "delete_update",
    "Fate",
    "list_updates",
    "read_update",
    "read_update_meta",
    "update_gone",
    "update_key",
    "update_path",
    "write_update",
]

logger = logging.getLogger(__name__)


def update_path(run_id: str, epoch: int, shard: int, attempt: int) -> str:
    """Where the update of one shard-training attempt lives, relative to ``<store>/runs``."""
    return f"{_folder(run_id)}/e{epoch:05d}-s{shard:05d}-a{attempt:03d}.safetensors"


_NAME = re.compile(r"e(\d{5,})-s(\d{5,})-a(\d{3,})\.safetensors$")


def update_key(path: str) -> tuple[int, int, int] | None:
    """``(epoch, shard, attempt)`` that :func:`update_path` named ``path`` after; None for another name."""
    found = _NAME.search(path)
    return None if found is None else (int(found[1]), int(found[2]), int(found[3]))


def _folder(run_id: str) -> str:
    return f"{run_id}/updates"


def write_update(
    files, path: str, params: FlatParams | EncodedUpdate | torch.nn.Module, meta: dict | None = None
) -> int:
    """Write ``params`` (and a small JSON ``meta`` record) to ``path`` in one request; return the bytes written.

    ``params`` may be the trained module itself (on the CPU): its tensors are written as they are,
    with no packed copy of them made first.
    """
    if isinstance(params, EncodedUpdate):
        tensors = dict(params.parts)
        layout = params.layout
        metadata = {"vcdask.codec": json.dumps({"codec": params.codec, "base_version": params.base_version})}
    else:
        if isinstance(params, FlatParams):
            layout = params.layout
            values = [params[e.name] for e in layout.entries]
        else:
            layout, values = state_tensors(params)
            values = [t.cpu() for t in values]  # (those on the CPU as they are)
        tensors = dict(zip(layout.names, values, strict=True))
        metadata = {}
    metadata["vcdask.layout"] = json.dumps(layout.to_dict())
    metadata["vcdask.meta"] = json.dumps(meta or {})
    return files.put_parts(path, st.dump_parts(tensors, metadata))


def read_update(files, path: str) -> FlatParams | EncodedUpdate:
    """Read an update written by :func:`write_update`: ``W_c``, or an :class:`EncodedUpdate` to decode
    against its base version."""
    data = files.get_buffer(path)  # the tensors are views of this one writable buffer: no further copy
    if not st.is_safetensors(data):
        return _read_npz_update(data)
    f = st.read(data)
    if "vcdask.layout" not in f.metadata:
        raise ValueError(f"{path!r} is a safetensors file without a vcdask layout: not an update")
    layout = Layout.from_dict(f.meta_json("vcdask.layout"))
    codec = f.meta_json("vcdask.codec")
    if codec is None:
        return FlatParams(layout, {d: _flat(f, layout, d) for d in layout.sizes})
    return EncodedUpdate(layout, codec["codec"], codec["base_version"], {n: f.tensor(n) for n in f.entries})


def _flat(f: st.TensorFile, layout: Layout, dtype: str) -> torch.Tensor:
    """The flat array of ``dtype``: a view of the file's tensors where the layout packs them in order
    (as every layout vcdask makes does), else assembled at the layout's offsets."""
    entries = [e for e in layout.entries if e.dtype == dtype]
    missing = [e.name for e in entries if e.name not in f.entries]
    if missing:
        raise ValueError(f"the update has no tensor {missing[0]!r} of its layout")
    packed, at = True, 0
    for e in entries:
        packed, at = packed and e.offset == at, at + e.size
    if packed:
        return f.flat([e.name for e in entries], torch_dtype(dtype))
    out = torch.empty(layout.sizes[dtype], dtype=torch_dtype(dtype))
    for e in entries:
        out[e.offset : e.offset + e.size] = f.tensor(e.name).reshape(-1)
    return out


def _read_npz_update(data: memoryview) -> FlatParams | EncodedUpdate:
    """An update in the ``.npz`` form of vcdask before stop 33."""
    z = _npz.loads(data)
    layout = Layout.from_dict(json.loads(z["__layout__"].tobytes()))
    if "__codec__" not in z:
        return FlatParams(layout, {dtype: _npz_torch(z[dtype], dtype) for dtype in layout.sizes})
    codec = json.loads(z["__codec__"].tobytes())
    parts = {}
    for name, a in z.items():
        if not name.startswith("__"):
            bf16 = codec["codec"] == "bf16" and name.endswith(".delta")  # stored as uint16
            parts[name] = _npz_torch(a, "bfloat16" if bf16 else None)
    return EncodedUpdate(layout, codec["codec"], codec["base_version"], parts)


def _npz_torch(a, dtype: str | None) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(torch_dtype(dtype)) if dtype == "bfloat16" else t


def read_update_meta(files, path: str) -> dict:
    """The ``meta`` record stored with an update (epoch, shard, attempt, base_step, ...)."""
    data = files.get(path)
    if st.is_safetensors(data):
        return st.read(data).meta_json("vcdask.meta", {})
    z = _npz.loads(data)
    return json.loads(z["__meta__"].tobytes()) if "__meta__" in z else {}


def list_updates(files, run_id: str) -> list[str]:
    """Paths of the run's updates still in the store."""
    return files.list(_folder(run_id))


#: What became of an update object: merged and committed in a version, turned down by the server, a
#: second copy of a shard merged already (or a late one), left over when the run ended, merged before
#: the scheduler that drove its run died (found by the resumed run), or not an update of this format.
Fate = Literal["committed", "rejected", "duplicate", "late", "run ended", "merged before a crash", "foreign"]


def update_gone(fate: Fate, keep_updates: bool) -> bool:
    """Whether an update whose ``fate`` is decided is deleted from the store: the one place that decides it.

    Every update has done its job once its fate is known, and goes, unless the run keeps its updates
    (``fit(keep_updates=True)``: to inspect them); an object in the run's folder that is no update of
    this format is no update to keep.
    """
    return fate == "foreign" or not keep_updates


def delete_update(files, path: str, *, strict: bool = False) -> bool:
    """Delete one update that has done its job (merged and committed, rejected, or a duplicate).

    Best effort unless ``strict``: a store fault is logged and the update is left for the end of the
    run (:func:`delete_run_updates`).  Returns whether it is gone.
    """
    try:
        files.delete(path)
        return True
    except OSError as e:
        if strict:
            raise
        logger.warning("could not delete the update %s (left for the end of the run): %s", path, e)
        return False


def delete_run_updates(files, run_id: str) -> None:
    """Delete every update of a run that is left (at its end); best effort."""
    try:
        for path in files.list(_folder(run_id), parts=True):  # with those a killed worker was writing
            files.delete(path)
    except OSError as e:  # the run's result does not depend on it
        logger.warning("run %s: could not remove its leftover update objects: %s", run_id, e)
