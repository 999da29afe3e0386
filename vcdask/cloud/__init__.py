"""Cloud fleets: spot/preemptible interruption notices (and, with dask-cloudprovider, spot clusters).

:class:`PreemptionWatcher` is a Dask worker plugin that polls the instance's metadata service for
the provider's notice and hands it to every vcdask run (:func:`vcdask.preempt`).  It needs nothing
beyond vcdask on the workers.  :func:`spot_cluster` builds a dask-cloudprovider spot fleet with it.
"""

from .clusters import SpotClusterSpec, spot_cluster, spot_cluster_spec
from .metadata import PROVIDERS, Notice
from .watcher import PreemptionWatcher

__all__ = ["PROVIDERS", "Notice", "PreemptionWatcher", "SpotClusterSpec", "spot_cluster", "spot_cluster_spec"]
