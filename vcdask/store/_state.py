"""A merge rule's state (e.g. momentum) beside the versions: only a branch's newest version keeps it.

Resuming a run needs the rule's state of the newest version of its branch only, so the state is
not part of a version (where every kept version would carry it forever): each commit writes it as
plain objects in ``<store>/runs/<branch>/rule-state/`` *before* the version, names them in the
version's metadata (``vcdask:state``), and deletes the objects no version names any more once the
new version has landed.  Versions written before this (with the state in ``/rule`` inside the
version) are still read.

An object is a safetensors file (:mod:`vcdask._safetensors`): for each state name, one flat array
per dtype (``"<name>/<dtype>"``), and the layouts in its metadata; a name whose arrays are all zero
is stored as its layout only (objects of vcdask before stop 33 are ``.npz`` files, still read).
``vcdask:state`` maps each state name to the object holding it (versions of vcdask before stop 32
name one object holding them all).  A commit writes only the arrays that changed since the branch's
last commit by this store object (:class:`StateWriter`): the default rule's momentum moves once per
window and its pending pseudo-gradient is zero right after, so most commits write one of its two
arrays, not both.
"""

from __future__ import annotations

import json
import logging
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .. import _npz
from .. import _safetensors as st
from ..params import FlatParams, Layout, torch_dtype
from ._checksum import STATE_CHECKSUM_KEY, verify
from ._version import version_id

__all__ = [
    "STATE_KEY",
    "StateWriter",
    "delete_state",
    "read_state",
    "read_state_object",
    "state_folder",
    "state_paths",
    "sweep_states",
    "write_state_object",
]

logger = logging.getLogger(__name__)

#: The version metadata key naming the version's state object (relative to ``<store>/runs``).
STATE_KEY = "vcdask:state"


def state_folder(branch: str) -> str:
    """Where a branch's rule state objects live, relative to ``<store>/runs``."""
    return f"{branch}/rule-state"


def write_state_object(
    files: Any, branch: str, state: Mapping[str, FlatParams], zeros: frozenset[str] | set[str] = frozenset()
) -> str:
    """Write ``state`` as a new object for ``branch`` (one request); return its path.  The names in
    ``zeros`` are stored as their layout only (their arrays are all zero)."""
    tensors: dict[str, torch.Tensor] = {}
    layouts = {}
    for name, flat in state.items():
        layouts[name] = flat.layout.to_dict()
        if name in zeros:
            continue
        for dtype, values in flat.arrays.items():
            tensors[f"{name}/{dtype}"] = values.detach().cpu()
    metadata = {"vcdask.layouts": json.dumps(layouts), "vcdask.zeros": json.dumps(sorted(zeros))}
    path = f"{state_folder(branch)}/{uuid.uuid4().hex}.safetensors"
    files.put_parts(path, st.dump_parts(tensors, metadata))
    return path


def read_state_object(files: Any, path: str) -> dict[str, FlatParams]:
    """The state in the object at ``path`` (FileNotFoundError when it is gone)."""
    data = files.get_buffer(path)  # the arrays are views of this one writable buffer
    if not st.is_safetensors(data):
        return _read_npz_state(data)
    f = st.read(data)
    if "vcdask.layouts" not in f.metadata:
        raise ValueError(f"{path!r} is a safetensors file without vcdask layouts: not a rule-state object")
    zeros = set(f.meta_json("vcdask.zeros", []))
    out = {}
    for name, layout_dict in f.meta_json("vcdask.layouts").items():
        layout = Layout.from_dict(layout_dict)
        arrays = {}
        for dtype, size in layout.sizes.items():
            if name in zeros:
                arrays[dtype] = torch.zeros(size, dtype=torch_dtype(dtype))
            else:
                arrays[dtype] = f.tensor(f"{name}/{dtype}")
        out[name] = FlatParams(layout, arrays)
    return out


def _read_npz_state(data: memoryview) -> dict[str, FlatParams]:
    """A state object in the ``.npz`` form of vcdask before stop 33."""
    z = _npz.loads(data)
    layouts = json.loads(z["__layouts__"].tobytes())
    zeros = set(json.loads(z["__zeros__"].tobytes())) if "__zeros__" in z else set()
    out = {}
    for name, layout_dict in layouts.items():
        layout = Layout.from_dict(layout_dict)
        arrays = {}
        for dtype, size in layout.sizes.items():
            if name in zeros:
                arrays[dtype] = torch.zeros(size, dtype=torch_dtype(dtype))
                continue
            t = torch.from_numpy(z[f"{name}/{dtype}"])
            arrays[dtype] = t.view(torch_dtype(dtype)) if dtype == "bfloat16" else t
        out[name] = FlatParams(layout, arrays)
    return out


def state_paths(value: Any) -> set[str]:
    """The objects a version's ``vcdask:state`` names (a mapping of names to objects, or one object)."""
    if not value:
        return set()
    return {value} if isinstance(value, str) else set(value.values())


def read_state_objects(files: Any, value: Any) -> dict[str, FlatParams]:
    """The state a version's ``vcdask:state`` names (FileNotFoundError when an object is gone)."""
    if isinstance(value, str):  # (one object holding every name)
        return read_state_object(files, value)
    objects: dict[str, dict[str, FlatParams]] = {}
    out = {}
    for name, path in value.items():
        if path not in objects:
            objects[path] = read_state_object(files, path)
        out[name] = objects[path][name]
    return out


class StateWriter:
    """Writes a branch's rule state at each commit, reusing the objects of arrays that have not changed.

    An array is unchanged when it is the same tensor as at the last commit (a weak reference, so a
    new tensor at a freed one's address is never taken for it) and PyTorch's version counter of it,
    which every in-place operation bumps, has not moved.  A write that bypasses the counter (through
    ``.data`` or a NumPy view) is not seen: rules change their state with torch operations.
    """

    def __init__(self) -> None:
        #: per branch: the version last committed and, per state name, its object and fingerprint
        self._last: dict[str, tuple[str, dict[str, tuple[str, Any]]]] = {}

    def write(
        self, files: Any, branch: str, head: str | None, state: Mapping[str, FlatParams]
    ) -> tuple[dict[str, str], dict[str, tuple[str, Any]]]:
        """Write what changed in ``state`` since this writer's last commit to ``branch``, if ``head`` (the
        branch head now) is that commit.  Returns the ``vcdask:state`` value naming every array's object,
        and the record to hand to :meth:`committed` once the commit has landed."""
        last = self._last.get(branch)
        known = last[1] if last is not None and last[0] == head else {}
        refs: dict[str, str] = {}
        fingerprints = {name: _fingerprint(flat) for name, flat in state.items()}
        changed = {}
        for name, flat in state.items():
            was = known.get(name)
            if was is not None and _same(was[1], fingerprints[name]):
                refs[name] = was[0]
            else:
                changed[name] = flat
        if changed:
            zeros = {n for n, flat in changed.items() if all(_all_zero(a) for a in flat.arrays.values())}
            path = write_state_object(files, branch, changed, zeros)
            refs.update(dict.fromkeys(changed, path))
        value = {name: refs[name] for name in state}
        return value, {name: (refs[name], fingerprints[name]) for name in state}

    def committed(self, branch: str, version: str, written: dict[str, tuple[str, Any]] | None) -> None:
        """A commit to ``branch`` landed as ``version``, with the state :meth:`write` returned ``written``
        for (None: a commit without state, after which nothing is reused)."""
        if written is None:
            self._last.pop(branch, None)
        else:
            self._last[branch] = (version, written)

    def forget(self, branch: str) -> None:
        """A commit to ``branch`` failed, or its objects may be gone (a collection): write every array next time."""
        self._last.pop(branch, None)


def _all_zero(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is zero bit for bit (``-0.0`` is not).

    A thousand values spread over ``t`` first: an array that is not all zeros (a rule's momentum) almost
    always shows it there, in microseconds; only one that passes is counted in full.  (``Tensor.any`` over
    5M int32 values took 4 ms, ``count_nonzero`` 1.5.)
    """
    if t.is_floating_point():
        t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    t = t.reshape(-1)
    if bool(t[:: max(1, t.numel() // 1024)].any()):
        return False
    return int(torch.count_nonzero(t)) == 0


def _fingerprint(flat: FlatParams) -> tuple[Any, ...]:
    arrays = tuple((dtype, weakref.ref(t), _version(t)) for dtype, t in sorted(flat.arrays.items()))
    return (*arrays, flat.layout)


def _version(t: torch.Tensor) -> int | None:
    """PyTorch's count of in-place changes to ``t`` (None where it keeps none: an inference tensor)."""
    try:
        return int(t._version)
    except (AttributeError, RuntimeError):
        return None


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    if len(a) != len(b) or not (a[-1] is b[-1] or a[-1] == b[-1]):
        return False
    for (d1, r1, v1), (d2, r2, v2) in zip(a[:-1], b[:-1], strict=True):
        t = r1()
        if d1 != d2 or t is None or t is not r2() or v1 is None or v1 != v2:
            return False
    return True


def read_state(store: Any, version: str) -> dict[str, FlatParams]:
    """The rule state of ``version`` of an Icechunk-backed ``store`` (its object, or ``/rule`` inside
    a version written by an earlier vcdask); Icechunk's errors are left to the caller."""
    import zarr

    from ..errors import VersionNotFoundError
    from ._layout import is_version, read_flat_at

    session = store._repo.readonly_session(snapshot_id=version_id(version))
    snap = store._repo.lookup_snapshot(version)
    if not is_version(snap):  # e.g. the repository's root snapshot
        raise VersionNotFoundError(f"{version!r} is not a vcdask version of {store.describe()}")
    meta = snap.metadata or {}
    value = meta.get(STATE_KEY)
    if value is not None:
        try:
            state = read_state_objects(store.files, value)
        except (FileNotFoundError, KeyError):
            raise VersionNotFoundError(
                f"the rule state of version {version!r} is no longer kept: only a branch's newest version "
                "keeps it (resuming needs nothing else), and a newer version replaced this one"
            ) from None
        recorded = meta.get(STATE_CHECKSUM_KEY) or {}
        for name, flat in state.items():
            where = f"the merge rule's state {name!r} of version {version!r} of {store.describe()}"
            verify(flat, recorded.get(name), where)
        return state
    root = zarr.open_group(session.store, mode="r")
    if "rule" not in root:
        return {}
    rule = zarr.open_group(session.store, mode="r", path="rule")
    return {name: read_flat_at(session.store, f"rule/{name}") for name in rule.group_keys()}


def delete_state(files: Any, value: Any, branch: str, keep: Any = None) -> None:
    """Delete the state objects ``value`` names that ``keep`` does not, if they belong to ``branch``
    (best effort: a later sweep retries).

    A branch made from another branch's version starts from that version's state objects, which
    belong to the other branch: they are left alone.
    """
    for path in sorted(state_paths(value) - state_paths(keep)):
        if not path.startswith(state_folder(branch) + "/"):
            continue
        try:
            files.delete(path)
        except OSError as e:
            logger.warning("could not delete the superseded rule state %s (a later collection retries): %s", path, e)


def sweep_states(files: Any, branch: str, keep: Any, *, written_before: float | None = None) -> int:
    """Delete every state object of ``branch`` but those ``keep`` (the newest version's ``vcdask:state``)
    names; return how many.  ``written_before`` (POSIX seconds): only objects written before then.

    Without ``written_before`` only the branch's own writer may call this (between its commits): an
    object written for a commit in progress would be taken too.  The temporary files of local writes
    are taken as the objects are (those a writer killed while it wrote left).
    """
    kept = state_paths(keep)
    gone = 0
    for path in files.list(state_folder(branch), written_before=written_before, parts=True):
        if path not in kept:
            files.delete(path)
            gone += 1
    return gone
