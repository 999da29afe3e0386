"""Spot and preemptible Dask clusters from dask-cloudprovider, set up for vcdask runs.

:func:`spot_cluster_spec` checks the options and says what would be built (no cloud call, no
dask-cloudprovider import); :func:`spot_cluster` builds it.  Every provider gets:

* spot/preemptible **workers** and an on-demand **scheduler** (a reclaimed scheduler would end the
  run; the workers may come and go);
* the :class:`~vcdask.cloud.PreemptionWatcher` plugin on every worker, for the provider's notice;
* a **lost-worker timeout** suited to churn (``distributed.scheduler.worker-ttl``, 60 s): a worker
  that vanished without a word is given up after a minute, not the default five;
* the **packages** the workers install at start (``EXTRA_PIP_PACKAGES``, read by Dask's images), and
  the provider for the watcher (``DASK_VCDASK__CLOUD__PREEMPTION__PROVIDER``) in their environment;
* optional **adaptive scaling** between ``minimum`` and ``maximum`` workers.

The torch-friendly allocator setting of the embedded cluster (no ``MALLOC_TRIM_THRESHOLD_``, see
:func:`vcdask.cluster.torch_friendly_environ`) cannot be expressed as an environment variable: Dask's
default sets it, and any value makes glibc drop its adaptive thresholds (the digits task took 74 ms
with 128 MiB against 51 ms unset, here).  Bake it into the workers' image instead (their
``~/.config/dask/distributed.yaml``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from .watcher import PreemptionWatcher

#: provider -> the dask-cloudprovider option that sizes the scheduler and the workers alike (the workers' type,
#: for the cost accounting, when ``worker_type=`` is not given)
SHARED_TYPE_KEYS = {"aws": "instance_type", "gcp": "machine_type"}

__all__ = ["PROVIDER_CLUSTERS", "SpotClusterSpec", "spot_cluster", "spot_cluster_spec"]

#: provider -> (dask-cloudprovider class, its spot switch, its image option, its environment option,
#: its worker instance-type option, its scheduler instance-type option, the watcher's provider)
PROVIDER_CLUSTERS: dict[str, tuple[str, str, str, str, str, str, str]] = {
    "aws": (
        "dask_cloudprovider.aws:EC2Cluster",
        "spot",
        "docker_image",
        "env_vars",
        "worker_instance_type",
        "scheduler_instance_type",
        "aws",
    ),
    "aws-fargate": (  # (FargateCluster runs the scheduler on FARGATE and the workers on FARGATE_SPOT)
        "dask_cloudprovider.aws:FargateCluster",
        "fargate_spot",
        "image",
        "environment",
        "",  # Fargate sizes tasks by CPU and memory (worker_cpu=, worker_mem=, passed on as they are)
        "",
        "",  # no watcher: a Fargate task has no instance metadata; AWS sends it a SIGTERM (docs: spot-fleets)
    ),
    "gcp": (
        "dask_cloudprovider.gcp:GCPCluster",
        "preemptible",
        "docker_image",
        "env_vars",
        "worker_machine_type",
        "scheduler_machine_type",
        "gcp",
    ),
}
#: What the workers install at start, when ``packages`` is not given.
DEFAULT_PACKAGES = ("vcdask", "torch")
#: Seconds without a heartbeat before the scheduler gives a worker up (Dask's default is 300).
WORKER_TTL = "60s"


@dataclass
class SpotClusterSpec:
    """What :func:`spot_cluster` builds: the class, its keyword arguments, and the plugins to register."""

    provider: str
    cluster_class: str
    kwargs: dict[str, Any]
    plugins: list[Any] = field(default_factory=list)
    minimum: int | None = None
    maximum: int | None = None

    def build(self) -> Any:
        """Start the cluster (cloud calls; needs ``pip install "vcdask[cloud]"``), register the plugins,
        and turn on adaptive scaling if bounds were given."""
        module, name = self.cluster_class.split(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError as e:
            raise ImportError(
                f"spot_cluster({self.provider!r}) needs dask-cloudprovider with its {self.provider.split('-')[0]} "
                f'extra: pip install "vcdask[cloud]" ({e})'
            ) from e
        cluster = cls(**self.kwargs)
        from distributed import Client

        with Client(cluster, set_as_default=False) as client:
            for plugin in self.plugins:
                client.register_plugin(plugin)
        if self.maximum is not None:
            cluster.adapt(minimum=self.minimum or 0, maximum=self.maximum)
        return cluster


def _count(name: str, value: Any, low: int = 0) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def spot_cluster_spec(
    provider: str,
    *,
    n_workers: int = 2,
    minimum: int | None = None,
    maximum: int | None = None,
    worker_type: str | None = None,
    scheduler_type: str | None = None,
    image: str | None = None,
    packages: str | tuple[str, ...] | list[str] | None = None,
    env: dict[str, str] | None = None,
    watcher: PreemptionWatcher | None = None,
    **cluster_kwargs: Any,
) -> SpotClusterSpec:
    """Check the options and say what :func:`spot_cluster` would build, without any cloud call.

    Parameters
    ----------
    provider : {"aws", "aws-fargate", "gcp"}
        EC2 spot instances, Fargate Spot tasks, or GCP preemptible VMs.  (dask-cloudprovider has no
        spot support for Azure VMs: run Azure Spot VMs yourself with ``PreemptionWatcher("azure")``.)
    n_workers : int, default 2
        Workers to start with.
    minimum, maximum : int, optional
        Adaptive scaling bounds (``cluster.adapt``); without ``maximum``, no adaptive scaling.
    worker_type, scheduler_type : str, optional
        Instance / machine types, given to the provider's option for them.  Fargate sizes its tasks by
        ``worker_cpu=`` / ``worker_mem=`` (and the scheduler's), passed on in ``**cluster_kwargs``; these two
        are refused there.  The workers report their type for the run's cost accounting
        (``vcdask.cloud.instance.type``): ``worker_type``, else the type given for the scheduler and the
        workers alike (EC2Cluster's ``instance_type=``, GCPCluster's ``machine_type=``).  Left to
        dask-cloudprovider's default, it is not known, and the workers are unpriced.
    image : str, optional
        The container image (default: dask-cloudprovider's, with ``packages`` installed at start).
    packages : str or sequence of str, optional
        pip requirements the workers install at start (default ``("vcdask", "torch")``; ``()`` for an
        image that has them); a string is one requirement (``"vcdask==0.4"``; several: a list).
    env : dict, optional
        More environment variables for the scheduler and workers.
    watcher : PreemptionWatcher, optional
        Default: ``PreemptionWatcher(provider="aws")`` for ``"aws"``, ``PreemptionWatcher(provider="gcp")`` for
        ``"gcp"``, and none for ``"aws-fargate"``: a Fargate task has no instance metadata to poll for a
        notice (AWS sends it a SIGTERM, which its worker takes as a shutdown: its shards are re-issued, without
        the drain).
    **cluster_kwargs
        Passed on to the dask-cloudprovider class (region, VPC, security, ...).

    Raises
    ------
    ValueError
        An unknown provider, a bad count, or an option that would make the workers on-demand.
    """
    if provider == "azure":
        raise ValueError(
            "spot_cluster('azure'): dask-cloudprovider's AzureVMCluster cannot start Spot VMs; start Azure Spot "
            "VMs running `dask worker` yourself and register vcdask.cloud.PreemptionWatcher(provider='azure')"
        )
    if provider not in PROVIDER_CLUSTERS:
        raise ValueError(f"unknown spot provider {provider!r}; valid providers: {sorted(PROVIDER_CLUSTERS)}")
    cls, spot_key, image_key, env_key, worker_key, scheduler_key, watch_as = PROVIDER_CLUSTERS[provider]
    n = _count("n_workers", n_workers)
    low, high = _count("minimum", minimum), _count("maximum", maximum, low=1)
    if low is not None and high is None:
        raise ValueError("minimum needs maximum: adaptive scaling takes both bounds (or only maximum)")
    if high is not None and (low or 0) > high:
        raise ValueError(f"minimum={low} is more than maximum={high}")
    if spot_key in cluster_kwargs and cluster_kwargs[spot_key] is not True:
        raise ValueError(
            f"{spot_key}={cluster_kwargs[spot_key]!r}: spot_cluster makes spot workers; "
            f"for on-demand ones use {cls.split(':')[1]} directly"
        )
    ours_for = {image_key: "image", env_key: "env", worker_key: "worker_type", scheduler_key: "scheduler_type"}
    for key, ours in ours_for.items():
        if key and key in cluster_kwargs:
            raise ValueError(f"pass {ours}= rather than {key}= (spot_cluster sets {key} from it)")
    if watcher is not None and not isinstance(watcher, PreemptionWatcher):
        raise TypeError(f"watcher must be a vcdask.cloud.PreemptionWatcher, got {type(watcher).__name__}")
    for name, value in (("worker_type", worker_type), ("scheduler_type", scheduler_type), ("image", image)):
        if value is not None and not (isinstance(value, str) and value):
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    # (a string is one requirement, not its characters)
    pkgs = DEFAULT_PACKAGES if packages is None else (packages,) if isinstance(packages, str) else tuple(packages)
    if not all(isinstance(p, str) and p and not any(c.isspace() for c in p) for p in pkgs):
        raise ValueError(
            f"packages must be pip requirements without spaces (several: a list, e.g. ['vcdask', 'torch']), "
            f"got {list(pkgs)!r}"
        )

    # (EC2Cluster's instance_type= / GCPCluster's machine_type= size the workers too, unless worker_type= does)
    shared = cluster_kwargs.get(SHARED_TYPE_KEYS.get(provider, ""))
    priced_as = worker_type or (shared if isinstance(shared, str) and shared else None)
    environment = {
        "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": WORKER_TTL,
        **({"DASK_VCDASK__CLOUD__PREEMPTION__PROVIDER": watch_as} if watch_as else {}),
        # what the workers report for the run's cost accounting (vcdask.cost)
        "DASK_VCDASK__CLOUD__INSTANCE__MARKET": "spot",
        **({"DASK_VCDASK__CLOUD__INSTANCE__TYPE": priced_as} if priced_as else {}),
        **({"EXTRA_PIP_PACKAGES": " ".join(pkgs)} if pkgs else {}),
        **{str(k): str(v) for k, v in (env or {}).items()},
    }
    kwargs: dict[str, Any] = {"n_workers": n, spot_key: True, env_key: environment, **cluster_kwargs}
    if not worker_key and (worker_type or scheduler_type):
        raise ValueError(
            f"{provider}: tasks are sized by worker_cpu= / worker_mem=, not worker_type= / scheduler_type="
        )
    for key, value in ((image_key, image), (worker_key, worker_type), (scheduler_key, scheduler_type)):
        if key and value is not None:
            kwargs[key] = value
    # (Fargate: none, unless given: a watcher there polls a metadata service that is not there, forever)
    plugins = [watcher] if watcher is not None else [PreemptionWatcher(provider=watch_as)] if watch_as else []
    return SpotClusterSpec(provider, cls, kwargs, plugins, minimum=low, maximum=high)


def spot_cluster(provider: str, **kwargs: Any) -> Any:
    """A dask-cloudprovider cluster of spot/preemptible workers, ready for :func:`vcdask.fit`.

    Takes the arguments of :func:`spot_cluster_spec` (which checks them all before any cloud
    call) and returns the started cluster.

    Examples
    --------
    >>> cluster = vcdask.cloud.spot_cluster("aws", n_workers=8, worker_type="c6i.2xlarge",
    ...                                     region="eu-west-1")  # doctest: +SKIP
    >>> result = vcdask.fit(model, "s3://bucket/train.zarr", client=cluster, store="s3://bucket/runs")  # doctest: +SKIP
    """
    return spot_cluster_spec(provider, **kwargs).build()
