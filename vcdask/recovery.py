"""What the store says about a run whose scheduler died: merged shards, finished epochs, pending uploads.

Everything here is store I/O; the run calls it from its merge thread, never on the event loop.
"""

from __future__ import annotations

from .updates import read_update_meta

__all__ = ["read_back"]


def read_back(state, store, branch: str, run_id: str, n_shards: int):
    """Load ``state`` from the branch head and read the run's history back from the store.

    Returns
    -------
    merged : dict epoch -> set of shards
        Every (epoch, shard) some committed version merged (from the versions' metadata).
    ends : dict epoch -> (step, version id)
        The version at which each fully merged epoch completed.
    attempts : dict (epoch, shard) -> int
        The next attempt number to use (keys of old attempts are never reused).
    pending : list of dict
        Records of updates uploaded but in no committed version, oldest base first; the
        uploads of already merged shards are deleted.
    """
    state.load()
    merged: dict[int, set[int]] = {}
    attempts: dict[tuple[int, int], int] = {}
    ends: dict[int, tuple[int, str]] = {}
    for info in reversed(store.versions(branch)):  # oldest first
        for epoch, shard, attempt in info.metadata.get("merged", []):
            merged.setdefault(epoch, set()).add(shard)
            attempts[(epoch, shard)] = max(attempts.get((epoch, shard), 0), attempt + 1)
            if len(merged[epoch]) == n_shards and epoch not in ends:
                ends[epoch] = (info.metadata["step"], info.id)
    pending = []
    for path in store.files.list(f"{run_id}/updates"):
        meta = read_update_meta(store.files, path)
        key = (meta.get("epoch"), meta.get("shard"))
        attempts[key] = max(attempts.get(key, 0), meta.get("attempt", 0) + 1)
        if not meta or meta["shard"] in merged.get(meta["epoch"], ()):
            store.files.delete(path)  # merged and committed before the crash
        else:
            pending.append(meta)
    pending.sort(key=lambda m: (m["epoch"], m["base_step"], m["shard"]))
    return merged, ends, attempts, pending
