"""spot_cluster's configuration for each provider, built without any network call."""

from __future__ import annotations

import importlib
import inspect
import socket

import pytest

from vcdask.cloud import PreemptionWatcher, spot_cluster, spot_cluster_spec


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Building a spec must not open a connection: fail the test if anything tries."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network call while building a spot cluster spec: {args!r}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.mark.parametrize(
    "provider, cls, spot, env_key",
    [
        ("aws", "dask_cloudprovider.aws:EC2Cluster", "spot", "env_vars"),
        ("aws-fargate", "dask_cloudprovider.aws:FargateCluster", "fargate_spot", "environment"),
        ("gcp", "dask_cloudprovider.gcp:GCPCluster", "preemptible", "env_vars"),
    ],
)
def test_each_provider_gets_spot_workers_the_watcher_and_the_environment(provider, cls, spot, env_key):
    spec = spot_cluster_spec(provider, n_workers=4, maximum=16, packages=["vcdask==0.1.0", "torch==2.13.0"])
    assert spec.cluster_class == cls
    assert spec.kwargs[spot] is True and spec.kwargs["n_workers"] == 4
    env = spec.kwargs[env_key]
    if provider == "aws-fargate":  # no instance metadata to watch: AWS sends the task a SIGTERM
        assert spec.plugins == [] and "DASK_VCDASK__CLOUD__PREEMPTION__PROVIDER" not in env
    else:
        (watcher,) = spec.plugins
        assert isinstance(watcher, PreemptionWatcher) and watcher.provider == provider
        assert env["DASK_VCDASK__CLOUD__PREEMPTION__PROVIDER"] == provider
    assert env["DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL"] == "60s"  # churn: a vanished worker is let go in a minute
    assert env["EXTRA_PIP_PACKAGES"] == "vcdask==0.1.0 torch==2.13.0"
    assert env["DASK_VCDASK__CLOUD__INSTANCE__MARKET"] == "spot"  # for the cost accounting
    assert (spec.minimum, spec.maximum) == (None, 16)


def test_instance_types_image_and_pass_through_options_land_where_the_provider_wants_them():
    aws = spot_cluster_spec(
        "aws", worker_type="c6i.2xlarge", scheduler_type="t3.large", image="ghcr.io/me/w:1", region="eu-west-1"
    )
    assert aws.kwargs["worker_instance_type"] == "c6i.2xlarge" and aws.kwargs["scheduler_instance_type"] == "t3.large"
    assert aws.kwargs["docker_image"] == "ghcr.io/me/w:1" and aws.kwargs["region"] == "eu-west-1"
    assert aws.kwargs["env_vars"]["DASK_VCDASK__CLOUD__INSTANCE__TYPE"] == "c6i.2xlarge"
    gcp = spot_cluster_spec("gcp", worker_type="e2-standard-4", packages=(), env={"A": 1})
    assert gcp.kwargs["worker_machine_type"] == "e2-standard-4"
    assert "EXTRA_PIP_PACKAGES" not in gcp.kwargs["env_vars"] and gcp.kwargs["env_vars"]["A"] == "1"
    mine = PreemptionWatcher(provider="gcp", interval=2)
    assert spot_cluster_spec("gcp", watcher=mine).plugins == [mine]


def test_the_aws_configuration_is_one_ec2cluster_accepts():
    """The keyword arguments bind to dask-cloudprovider's own EC2Cluster (and its VMCluster base)."""
    ec2 = pytest.importorskip("dask_cloudprovider.aws.ec2")
    vm = importlib.import_module("dask_cloudprovider.generic.vmcluster")
    spec = spot_cluster_spec("aws", n_workers=3, worker_type="m6i.large", image="img", region="us-east-2")
    own = set(inspect.signature(ec2.EC2Cluster.__init__).parameters)
    base = set(inspect.signature(vm.VMCluster.__init__).parameters)
    assert set(spec.kwargs) <= (own | base) - {"self", "kwargs", "args"}, set(spec.kwargs) - own - base


def test_bad_options_raise_clear_errors_before_any_cloud_call():
    with pytest.raises(
        ValueError, match=r"unknown spot provider 'ibm'; valid providers: \['aws', 'aws-fargate', 'gcp'\]"
    ):
        spot_cluster_spec("ibm")
    with pytest.raises(
        ValueError, match=r"AzureVMCluster cannot start Spot VMs.*PreemptionWatcher\(provider='azure'\)"
    ):
        spot_cluster("azure")
    with pytest.raises(ValueError, match="n_workers must be an integer >= 0, got -1"):
        spot_cluster_spec("aws", n_workers=-1)
    with pytest.raises(ValueError, match="minimum=5 is more than maximum=2"):
        spot_cluster_spec("aws", minimum=5, maximum=2)
    with pytest.raises(ValueError, match="minimum needs maximum"):
        spot_cluster_spec("aws", minimum=1)
    with pytest.raises(
        ValueError, match=r"spot=False: spot_cluster makes spot workers; for on-demand ones use EC2Cluster"
    ):
        spot_cluster_spec("aws", spot=False)
    with pytest.raises(ValueError, match=r"pass image= rather than docker_image="):
        spot_cluster_spec("gcp", docker_image="x")
    with pytest.raises(ValueError, match=r"tasks are sized by worker_cpu= / worker_mem="):
        spot_cluster_spec("aws-fargate", worker_type="m5.large")
    with pytest.raises(ValueError, match=r"packages must be pip requirements without spaces"):
        spot_cluster_spec("aws", packages=["torch vcdask"])
    with pytest.raises(TypeError, match="watcher must be a vcdask.cloud.PreemptionWatcher, got str"):
        spot_cluster_spec("aws", watcher="aws")


@pytest.mark.parametrize(
    "provider, option, kind",
    [("aws", "instance_type", "c6i.2xlarge"), ("gcp", "machine_type", "e2-standard-4")],
)
def test_the_workers_report_the_type_the_providers_own_option_gave_them(provider, option, kind):
    spec = spot_cluster_spec(provider, **{option: kind})
    env_key = "env_vars"  # (EC2Cluster's and GCPCluster's both)
    assert spec.kwargs[option] == kind  # passed on as it is
    assert spec.kwargs[env_key]["DASK_VCDASK__CLOUD__INSTANCE__TYPE"] == kind  # so the cost can price them
    # worker_type= is the workers' own: it wins over the type shared with the scheduler
    both = spot_cluster_spec(provider, worker_type="big-one", **{option: kind})
    assert both.kwargs[env_key]["DASK_VCDASK__CLOUD__INSTANCE__TYPE"] == "big-one"
