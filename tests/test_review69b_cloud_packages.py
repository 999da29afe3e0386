"""spot_cluster_spec: ``packages="vcdask"`` is one requirement (it was split into its characters)."""

from __future__ import annotations

import pytest

from vcdask.cloud import spot_cluster_spec


def test_a_string_of_packages_is_one_requirement():
    spec = spot_cluster_spec("aws", packages="vcdask==0.4.0")
    assert spec.kwargs["env_vars"]["EXTRA_PIP_PACKAGES"] == "vcdask==0.4.0"
    spec = spot_cluster_spec("gcp", packages=["vcdask", "torch"])  # several: a sequence, as before
    assert spec.kwargs["env_vars"]["EXTRA_PIP_PACKAGES"] == "vcdask torch"
    with pytest.raises(ValueError, match=r"several: a list, e\.g\. \['vcdask', 'torch'\]\), got \['vcdask torch'\]"):
        spot_cluster_spec("aws", packages="vcdask torch")  # whitespace is still refused
    with pytest.raises(ValueError, match=r"packages must be pip requirements without spaces .*got \[''\]"):
        spot_cluster_spec("aws", packages="")
