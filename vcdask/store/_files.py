"""Plain objects beside a store's Icechunk repository: run specifications and client updates.

They live under ``<store>/runs/<run_id>/``; Icechunk never reads or deletes them.
"""

from __future__ import annotations

from typing import Any

from ..errors import ReadOnlyStoreError, StoreAccessDeniedError, StoreError

__all__ = ["SideFiles"]


def _fault(e: OSError, what: str) -> StoreError:
    """A store error for a storage request that failed (a refused credential is not transient)."""
    if isinstance(e, StoreError):
        return e
    if isinstance(e, PermissionError):
        return StoreAccessDeniedError(f"{what}: {e}")
    return StoreError(f"{what}: {e}")


class SideFiles:
    """put / get / delete / list of whole objects, through fsspec, one request each."""

    def __init__(self, fs: Any, root: str, where: str, *, writable: bool = True):
        self.fs = fs
        self.root = root
        self.where = where
        self.writable = writable

    def _path(self, path: str) -> str:
        return f"{self.root}/{path.lstrip('/')}"

    def put(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (relative to ``<store>/runs``), replacing any object there."""
        if not self.writable:
            raise ReadOnlyStoreError(f"cannot write {path!r} to {self.where}: it was opened with mode='r'")
        try:
            self.fs.pipe_file(self._path(path), data)
        except OSError as e:
            raise _fault(e, f"writing {path!r} to {self.where}") from e

    def get(self, path: str) -> bytes:
        """Read the object at ``path``; FileNotFoundError if it does not exist."""
        try:
            return self.fs.cat_file(self._path(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"no object {path!r} in {self.where}") from None
        except OSError as e:
            raise _fault(e, f"reading {path!r} from {self.where}") from e

    def exists(self, path: str) -> bool:
        try:
            return self.fs.exists(self._path(path))
        except OSError as e:
            raise _fault(e, f"looking for {path!r} in {self.where}") from e

    def delete(self, path: str) -> None:
        """Remove ``path`` if it exists."""
        try:
            self.fs.rm_file(self._path(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _fault(e, f"deleting {path!r} from {self.where}") from e

    def list(self, prefix: str) -> list[str]:
        """Paths (relative to ``<store>/runs``) of the objects under ``prefix``."""
        base = self._path(prefix).rstrip("/")
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _fault(e, f"listing {prefix!r} in {self.where}") from e
        strip = len(self.root.strip("/")) + 1
        return sorted(p.strip("/")[strip:] for p in found)
