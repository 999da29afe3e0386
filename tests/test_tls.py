"""fit on a cluster that requires TLS (distributed.security.Security), end to end on real processes."""

from __future__ import annotations

import pytest
from distributed import Client
from distributed.security import Security

import vcdask
from vcdask.cluster import embedded_cluster
from vcdask.demo import accuracy_on, digits_cnn
from vcdask.engine.inflight import run_client_security


def _without_client_cert(sec: Security) -> Security:
    """The scheduler's and workers' certificates only, as a cluster gets when each role has its own."""
    fields = {k: getattr(sec, k) for k in Security.__slots__ if k not in ("extra_conn_args",)}
    fields.update(tls_client_cert=None, tls_client_key=None)
    return Security(**fields)


@pytest.mark.cluster
def test_fit_on_a_cluster_that_requires_encryption(digits_data, tmp_path):
    (X, y), (Xt, yt) = digits_data
    sec = Security.temporary()  # self-signed, require_encryption=True
    assert sec.require_encryption
    with embedded_cluster(n_workers=2, security=sec) as cluster:
        address = cluster.scheduler_address
        assert address.startswith("tls://")
        # plaintext, and TLS without the cluster's certificates, are refused
        with pytest.raises((OSError, TimeoutError)):
            Client(address.replace("tls://", "tcp://"), timeout="2s", set_as_default=False)
        with pytest.raises((OSError, TimeoutError, TypeError)):
            Client(address, timeout="2s", set_as_default=False)
        with Client(cluster, security=sec, set_as_default=False) as client:
            result = vcdask.fit(
                digits_cnn(0),
                (X, y),
                client=client,
                store=tmp_path / "s",
                max_epochs=3,
                progress=False,
                retention=False,
            )
    h = result.history
    assert h.accepted.all() and sorted(set(h.epoch)) == [1, 2, 3]
    assert all(w.startswith("tls://") for w in h.worker)  # every update came over TLS
    model = vcdask.load(result.store, digits_cnn(0), branch=result.run_id)
    assert accuracy_on(model, Xt, yt) > 0.3  # it trained (chance: 0.1; 0.48-0.65 after 2 epochs, measured)
    losses = h.groupby("epoch").train_loss.mean()
    assert losses[3] < losses[1]


def test_the_runs_client_uses_the_scheduler_certificate_when_it_has_no_client_one():
    sec = Security.temporary()
    scheduler_only = _without_client_cert(sec)

    class Scheduler:
        security = scheduler_only

    derived = run_client_security(Scheduler())
    assert derived.tls_client_cert == sec.tls_scheduler_cert and derived.tls_client_key == sec.tls_scheduler_key
    assert derived.require_encryption and derived.tls_ca_file == sec.tls_ca_file
    assert derived.get_connection_args("client")["ssl_context"] is not None
    Scheduler.security = sec  # a client certificate is used as given
    assert run_client_security(Scheduler()) is sec
    Scheduler.security = None  # no TLS
    assert run_client_security(Scheduler()) is None
