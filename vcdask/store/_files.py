"""Plain objects beside a store's Icechunk repository: run specifications and client updates.

They live under ``<store>/runs/<run_id>/``; Icechunk never reads or deletes them.
"""

from __future__ import annotations

from typing import Any

from ..errors import ReadOnlyStoreError, StoreError

__all__ = ["SideFiles"]


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
            raise StoreError(f"writing {path!r} to {self.where}: {e}") from e

    def get(self, path: str) -> bytes:
        """Read the object at ``path``; FileNotFoundError if it does not exist."""
        try:
            return self.fs.cat_file(self._path(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"no object {path!r} in {self.where}") from None

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._path(path))

    def delete(self, path: str) -> None:
        """Remove ``path`` if it exists."""
        try:
            self.fs.rm_file(self._path(path))
        except FileNotFoundError:
            pass

    def list(self, prefix: str) -> list[str]:
        """Paths (relative to ``<store>/runs``) of the objects under ``prefix``."""
        base = self._path(prefix).rstrip("/")
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        strip = len(self.root.strip("/")) + 1
        return sorted(p.strip("/")[strip:] for p in found)
