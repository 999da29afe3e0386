"""The credentials an Icechunk session (or its store) would carry where it is pickled.

Icechunk pickles a store as its Rust state (``IcechunkStore.__getstate__``: msgpack bytes), and that state holds
the repository's storage *with its credentials*: ``icechunk.s3_storage(access_key_id=..., secret_access_key=...)``
puts them into every pickle of every session of the repository, and so into a run's spec and its tasks'
arguments when the session is given as training data.  :func:`session_credentials` reads that state as pickling
would write it and names the kinds of secrets it holds, never their values.

What is read (Icechunk 1.x, msgpack through rmp-serde): a credential is an enum tagged with its kind, written
as an array (``["static", key_id, secret, token, expiry]``, ``["s3", "static", ...]`` for a virtual chunk
container) or a map (``{"s3_credential_type": "refreshable", ..., "initial": [...]}``).  Only credentials that
each process resolves itself pass: ``from_env``, ``anonymous`` (``none``), and ``refreshable`` ones with no
initial credentials (a pickled function, called where the store is used).  Anything else is a secret: ``static``
ones, refreshable ones that carry their first credentials, a kind this module does not know, a secret config
entry or header (:func:`._secret_options.is_secret_option`); and state that cannot be read as above fails closed
(reported as such), so that a newer Icechunk that writes it otherwise is refused rather than trusted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._secret_options import SECRET_HEADERS, is_secret_option

__all__ = ["session_credentials"]

#: Credential kinds that hold no secret: the process that uses the store finds its own.
_RESOLVED_THERE = frozenset({"from_env", "anonymous", "none"})
#: Credential kinds that may hold one (a refreshable credential: when it carries initial credentials).
_HELD = frozenset({"static", "refreshable"})
#: The provider tag before a virtual chunk container's credential (``["s3", "static", ...]``).
_PROVIDERS = frozenset({"s3", "gcs", "azure", "r2", "tigris"})
UNREADABLE = "a state vcdask cannot check for credentials"


def session_credentials(obj: Any) -> list[str]:
    """The kinds of credentials that a pickle of ``obj`` (an Icechunk session or store) would carry, sorted:
    e.g. ``["static credentials"]``; empty when it carries none (or cannot be pickled at all: a writable
    session, which Icechunk refuses to pickle).  Never a value.
    """
    store = obj.store if hasattr(obj, "snapshot_id") and hasattr(obj, "store") else obj  # (a Session: its store)
    getstate = getattr(store, "__getstate__", None)
    if getstate is None:
        return [UNREADABLE]
    try:
        state = getstate()
    except (ValueError, TypeError):  # (not picklable: Icechunk's refusal of a writable session)
        return []
    blobs = [v for v in state.values() if isinstance(v, bytes)] if isinstance(state, Mapping) else []
    if not blobs:
        return [UNREADABLE]
    found: set[str] = set()
    for blob in blobs:
        try:
            import msgpack  # (a dependency of distributed)

            tree = msgpack.unpackb(blob, raw=False, strict_map_key=False, unicode_errors="surrogateescape")
        except Exception:  # noqa: BLE001 - any failure to read it: not known to be free of secrets
            found.add(UNREADABLE)
            continue
        _walk(tree, found)
    return sorted(found)


def _walk(node: Any, found: set[str]) -> None:
    if isinstance(node, Mapping):
        for key, value in node.items():
            if not isinstance(key, str):
                continue
            # ({"s3_credential_type": ...}; not the inner gcs_static_credential_type of a static one)
            if key.endswith("credential_type") and "static" not in key and isinstance(value, str):
                _kind(value, node.get("initial", "absent"), found)
            elif key == "credentials" and isinstance(value, (list, tuple)) and value and isinstance(value[0], str):
                _kind(value[0], "unknown", found)  # (["from_env"], ["static", ...]; a kind not known: a secret)
            elif isinstance(value, str) and value and is_secret_option(key) and not key.endswith("_type"):
                found.add(f"the secret entry {key!r}")  # (an object_store config key, a header)
        for value in node.values():
            _walk(value, found)
    elif isinstance(node, (list, tuple)):
        head = node[0] if node and isinstance(node[0], str) else None
        tag = node[1] if head in _PROVIDERS and len(node) > 1 else head
        if isinstance(tag, str) and tag in _HELD:  # (array-tagged: a refreshable one's initial credentials unknown)
            _kind(tag, "unknown", found)
        if len(node) == 2 and isinstance(head, str) and head.lower() in SECRET_HEADERS:  # (a header pair)
            found.add(f"the header {head!r}")
        for value in node:
            _walk(value, found)


def _kind(kind: str, initial: Any, found: set[str]) -> None:
    if kind in _RESOLVED_THERE or (kind == "refreshable" and initial is None):
        return
    if kind == "refreshable":
        found.add(f"refreshable credentials {'with' if initial != 'unknown' else 'perhaps with'} initial credentials")
    else:
        found.add(f"{kind} credentials")
