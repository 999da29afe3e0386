"""Cloud fleets: spot/preemptible interruption notices (and, with dask-cloudprovider, spot clusters).

:class:`PreemptionWatcher` is a Dask worker plugin that polls the instance's metadata service for
the provider's notice and hands it to every vcdask run (:func:`vcdask.preempt`).  It needs nothing
beyond vcdask on the workers.
"""

from .metadata import PROVIDERS, Notice
from .watcher import PreemptionWatcher

__all__ = ["PROVIDERS", "Notice", "PreemptionWatcher"]
