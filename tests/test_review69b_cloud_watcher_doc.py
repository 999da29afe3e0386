"""spot_cluster_spec's documented default watcher is what each provider gets (none on Fargate)."""

from __future__ import annotations

from vcdask.cloud import PreemptionWatcher, spot_cluster_spec


def test_the_default_watcher_is_as_documented_for_each_provider():
    doc = spot_cluster_spec.__doc__ or ""
    watcher_doc = " ".join(doc.split("watcher : PreemptionWatcher, optional")[1].split("**cluster_kwargs")[0].split())
    assert 'none for ``"aws-fargate"``' in watcher_doc
    assert spot_cluster_spec("aws-fargate").plugins == []
    for provider in ("aws", "gcp"):
        assert f'``PreemptionWatcher(provider="{provider}")`` for ``"{provider}"``' in watcher_doc
        (watcher,) = spot_cluster_spec(provider).plugins
        assert isinstance(watcher, PreemptionWatcher) and watcher.provider == provider
