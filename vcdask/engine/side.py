"""The merge path's side thread: reading the next queued update ahead, deleting merged ones.

It touches the store's files only, never ``W_s``: the merge thread stays the one thread that does.  One
thread, so its reads and deletes run in the order they were asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..updates import delete_update, read_update

__all__ = ["SideThread"]


class SideThread:
    """Reads ahead and deletes for one run's merge path (:class:`~.params_server.ParamsServer`).

    Parameters
    ----------
    files : vcdask.store.FileStore-like
        The store's files, where updates are.
    """

    def __init__(self, files: Any):
        self.files = files
        self._executor: ThreadPoolExecutor | None = None
        self._ahead: tuple[str, Future[Any]] | None = None  # the next queued update's path, and its read

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="vcdask-merge-side")
        return self._executor.submit(fn, *args)

    def read(self, path: str, read_now: Callable[[], Any], ahead: str | None = None) -> Any:
        """The update at ``path``: the read started ahead for it, else ``read_now()``; then start reading
        ``ahead`` (the update queued next).  A read ahead that failed is made again by ``read_now`` (through
        the store's outages: an unreadable update then fails there as it would have)."""
        got, self._ahead = self._ahead, None
        client = None
        if got is not None and got[0] == path:
            try:
                client = got[1].result()
            except Exception:  # noqa: BLE001 (whatever it was, read_now meets it again, or not)
                client = None
        if client is None:
            client = read_now()
        if ahead is not None and ahead != path:
            self._ahead = (ahead, self._submit(read_update, self.files, ahead))
        return client

    def delete(self, path: str) -> None:
        """Delete a merged and committed update, off the merge path (a 400 MB file takes 20-50 ms to unlink)."""
        self._submit(delete_update, self.files, path)

    def drain(self) -> None:
        """Wait for the reads and deletes asked for so far."""
        if self._executor is not None:
            self._submit(lambda: None).result()

    def close(self) -> None:
        """Let the thread go once its queued work is done (the run has ended)."""
        self._ahead = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    @property
    def closed(self) -> bool:
        """No thread is running (none was needed yet, or :meth:`close` let it go)."""
        return self._executor is None
