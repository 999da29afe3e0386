"""A merge rule's state (e.g. momentum) beside the versions: only a branch's newest version keeps it.

Resuming a run needs the rule's state of the newest version of its branch only, so the state is
not part of a version (where every kept version would carry it forever): each commit writes it as
one plain object in ``<store>/runs/<branch>/rule-state/`` *before* the version, names it in the
version's metadata (``vcdask:state``), and deletes the state of the version it replaced once the
new version has landed.  Versions written before this (with the state in ``/rule`` inside the
version) are still read.

An object is an uncompressed ``.npz``: for each state name, one array per dtype and the layout.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import _npz
from ..params import FlatParams, Layout, torch_dtype

__all__ = [
    "STATE_KEY",
    "delete_state",
    "read_state",
    "read_state_object",
    "state_folder",
    "sweep_states",
    "write_state_object",
]

logger = logging.getLogger(__name__)

#: The version metadata key naming the version's state object (relative to ``<store>/runs``).
STATE_KEY = "vcdask:state"


def state_folder(branch: str) -> str:
    """Where a branch's rule state objects live, relative to ``<store>/runs``."""
    return f"{branch}/rule-state"


def write_state_object(files: Any, branch: str, state: Mapping[str, FlatParams]) -> str:
    """Write ``state`` as a new object for ``branch`` (one request); return its path."""
    arrays: dict[str, np.ndarray] = {}
    layouts = {}
    for name, flat in state.items():
        layouts[name] = flat.layout.to_dict()
        for dtype, values in flat.arrays.items():
            data = values.view(torch.uint16) if dtype == "bfloat16" else values
            arrays[f"{name}/{dtype}"] = data.detach().cpu().numpy()
    arrays["__layouts__"] = np.frombuffer(json.dumps(layouts).encode(), dtype=np.uint8)
    path = f"{state_folder(branch)}/{uuid.uuid4().hex}.npz"
    files.put(path, _npz.dumps(arrays))
    return path


def read_state_object(files: Any, path: str) -> dict[str, FlatParams]:
    """The state in the object at ``path`` (FileNotFoundError when it is gone)."""
    z = _npz.loads(bytearray(files.get(path)))  # arrays viewing one writable buffer
    layouts = json.loads(z["__layouts__"].tobytes())
    out = {}
    for name, layout_dict in layouts.items():
        layout = Layout.from_dict(layout_dict)
        arrays = {}
        for dtype in layout.sizes:
            t = torch.from_numpy(z[f"{name}/{dtype}"])
            arrays[dtype] = t.view(torch_dtype(dtype)) if dtype == "bfloat16" else t
        out[name] = FlatParams(layout, arrays)
    return out


def read_state(store: Any, version: str) -> dict[str, FlatParams]:
    """The rule state of ``version`` of an Icechunk-backed ``store`` (its object, or ``/rule`` inside
    a version written by an earlier vcdask); Icechunk's errors are left to the caller."""
    import zarr

    from ..errors import VersionNotFoundError
    from ._layout import read_flat

    session = store._repo.readonly_session(snapshot_id=version)
    path = (store._repo.lookup_snapshot(version).metadata or {}).get(STATE_KEY)
    if path is not None:
        try:
            return read_state_object(store.files, path)
        except FileNotFoundError:
            raise VersionNotFoundError(
                f"the rule state of version {version!r} is no longer kept: only a branch's newest version "
                "keeps it (resuming needs nothing else), and a newer version replaced this one"
            ) from None
    root = zarr.open_group(session.store, mode="r")
    if "rule" not in root:
        return {}
    rule = zarr.open_group(session.store, mode="r", path="rule")
    return {name: read_flat(group) for name, group in rule.groups()}


def delete_state(files: Any, path: str | None, branch: str) -> None:
    """Delete the state object ``path`` if it belongs to ``branch`` (best effort: a later sweep retries).

    A branch made from another branch's version starts from that version's state object, which
    belongs to the other branch: it is left alone.
    """
    if not path or not path.startswith(state_folder(branch) + "/"):
        return
    try:
        files.delete(path)
    except OSError as e:
        logger.warning("could not delete the superseded rule state %s (a later collection retries): %s", path, e)


def sweep_states(files: Any, branch: str, keep: str | None) -> int:
    """Delete every state object of ``branch`` but ``keep`` (the newest version's); return how many.

    Only the branch's own writer may call this (between its commits): an object written for a
    commit in progress would be taken too.
    """
    gone = 0
    for path in files.list(state_folder(branch)):
        if path != keep:
            files.delete(path)
            gone += 1
    return gone
