"""Where :func:`vcdask.options.plan` computes on the run's dask data: :class:`DataComputing`."""

from __future__ import annotations

from typing import Any

__all__ = ["DataComputing"]


class DataComputing:
    """Where :func:`plan` computes on dask data (its first rows, the labels' range, the NaN / inf scan; Zarr data
    too, scanned through dask): the cluster of ``client=``, whose workers stage and train on it, never this
    process nor a default Client of another cluster (``data.md``: dask data never goes through your process).

    A Client is used as given.  A cluster object or a scheduler's address is connected to once, at the first
    computation (data in memory connects to nothing, so input refused before any computation is refused before
    any cluster work), as :func:`vcdask.cluster.resolve_client` would (``set_as_default=False``); the run then
    runs on that Client (:attr:`RunPlan.client`), not on a second one.  Without ``client=`` the run goes to the
    embedded LocalCluster, which runs on this machine, reading what this process reads: the data is computed
    here, by dask's threads, before that cluster is started (starting it to check the data would be cluster
    work before the checks).
    """

    def __init__(self, client: Any) -> None:
        self.given = client
        self.opened: Any = None  # the Client connected for a cluster object or an address

    @property
    def scheduler(self) -> Any:
        """:func:`dask.compute`'s ``scheduler=`` for the data of this run."""
        from distributed import Client

        if self.given is None:
            return "threads"
        if isinstance(self.given, Client):
            return self.given
        return self._get  # (connects at the first computation only)

    def _get(self, dsk: Any, keys: Any, **kwargs: Any) -> Any:
        if self.opened is None:
            from distributed import Client

            self.opened = Client(self.given, set_as_default=False)
        return self.opened.get(dsk, keys, **kwargs)

    def close(self) -> None:
        """Close the Client connected here (a run that will not start)."""
        if self.opened is not None:
            self.opened.close()
            self.opened = None
