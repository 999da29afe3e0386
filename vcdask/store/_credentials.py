"""Store credentials: kept in the processes that use them, never in the store, never in task arguments.

A store pickles as its location and its non-secret options.  Where it is unpickled (a Dask
worker, the scheduler) the secrets come from, in order:

1. this process's credential registry, filled by opening a store with explicit secret options
   (``open_store("s3://...", secret_access_key=...)``), by the worker plugin
   :class:`StoreCredentials`, or by :func:`share_credentials`;
2. the provider's standard chain: environment variables (``AWS_ACCESS_KEY_ID`` ...), an AWS
   profile (``AWS_PROFILE``), an instance role or workload identity.

Secrets given on the client reach the cluster only if you ask for it with
:func:`share_credentials`; :func:`check_cluster_access` tells, before any work starts, which
processes of a cluster cannot read a store.

The registry itself, and the redaction of its secrets from messages, are in :mod:`._secrets`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin

from ..errors import InvalidLocationError, StoreAccessDeniedError, StoreCredentialsError, StoreError
from ._base import ParamStore
from ._object import _ALIASES, CONFIG_SECRET
from ._schemes import BACKENDS, scheme_of
from ._secret_options import FSSPEC_SECRET_OPTIONS, is_secret_config_key
from ._secrets import _EnvVar, _key, forget_credentials, lookup_credentials, redact, remember, remembered

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from distributed import Client

__all__ = [
    "FSSPEC_SECRET_OPTIONS",
    "StoreCredentials",
    "check_cluster_access",
    "forget_credentials",
    "lookup_credentials",
    "redact",
    "register_credentials",
    "share_credentials",
    "store_holds_secrets",
]


def _location(store_or_location: ParamStore | str | os.PathLike) -> str:
    if isinstance(store_or_location, ParamStore):
        return store_or_location.location
    return os.fspath(store_or_location)


def _canonical(location: str, secrets: Mapping[str, Any]) -> dict[str, Any]:
    """``secrets`` under their canonical names; a name that is not a secret option of the backend raises."""
    backend = BACKENDS.get(scheme_of(location))
    names: frozenset[str] = getattr(backend, "secret_options", frozenset())
    takes_config = "config" in getattr(backend, "valid_options", ())
    out = {_ALIASES.get(k, k): v for k, v in secrets.items()}
    unknown = sorted(
        k
        for k in set(out) - names
        # a secret entry of the backend's config (GCS, Azure): config.<key>, e.g. config.azure_client_secret
        if not (takes_config and k.startswith(CONFIG_SECRET) and is_secret_config_key(k[len(CONFIG_SECRET) :]))
    )
    if unknown:
        more = f" and {CONFIG_SECRET}<secret config key>" if takes_config else ""
        raise InvalidLocationError(
            f"{unknown} are not secret options of {location!r}; its secret options: {sorted(names)}{more}"
        )
    return out


def register_credentials(location: str, **secrets: str) -> None:
    """Use ``secrets`` in this process for the store at ``location`` (replacing any registered before).

    A store unpickled in this process (a task's argument, a run's spec) reopens ``location``
    with them.  Opening a store with explicit secret options registers them already.

    Parameters
    ----------
    location : str
        The store's location, e.g. ``"s3://bucket/prefix"``.
    **secrets : str
        Secret storage options (S3: ``access_key_id``, ``secret_access_key``, ``session_token``).

    Raises
    ------
    InvalidLocationError
        A name that is not a secret option of the location's backend (the message lists them).
    """
    remember(location, _canonical(location, secrets))


def store_holds_secrets(store: ParamStore | str) -> bool:
    """Whether ``store`` was opened in this process with explicit secret options.

    Such a store cannot give those secrets to other processes: unpickled there, it uses their
    own credentials.  Check them with :func:`check_cluster_access` before a run.
    """
    return isinstance(store, ParamStore) and store.holds_secrets


class StoreCredentials(WorkerPlugin):
    """A Dask worker plugin that gives every worker (present and future) a store's credentials.

    The secrets travel inside the plugin over the cluster's connections (use TLS, e.g.
    ``distributed.security.Security``, on an untrusted network) and are kept by the scheduler
    for workers that join later; they are never written into the store.  Give ``env`` instead to
    send only the *names* of environment variables that each worker reads in its own environment.
    Most users call :func:`share_credentials`, which also registers them on the scheduler.

    Dask's DEBUG logging (``distributed.core``, ``distributed.scheduler``, ``distributed.worker``) may print
    the plugin's pickled message, secrets included, and botocore's prints request headers such as
    ``X-Amz-Security-Token``: keep those loggers above DEBUG where logs are kept, or send no secret (``env``,
    or credentials the machines have: an instance role, the environment).

    Parameters
    ----------
    location : str
        The store's location (``store.location``).
    env : mapping of str to str, optional
        Secret option -> name of the environment variable holding it on the workers,
        e.g. ``{"secret_access_key": "TEAM_S3_SECRET"}``.
    **secrets : str
        Secret options with their values (S3: ``access_key_id``, ``secret_access_key``,
        ``session_token``; GCS: ``service_account_key``, ``bearer_token``; Azure: ``access_key``,
        ``sas_token``, ``bearer_token``).

    Examples
    --------
    >>> plugin = StoreCredentials("s3://bucket/params", env={"secret_access_key": "TEAM_S3_SECRET"})
    >>> plugin  # doctest: +ELLIPSIS
    <StoreCredentials 's3://bucket/params' secret_access_key>
    """

    idempotent = False

    def __init__(self, location: str, *, env: Mapping[str, str] | None = None, **secrets: str):
        self.location = _location(location)
        named = {k: _EnvVar(v) for k, v in (env or {}).items()}
        self.secrets: dict[str, Any] = _canonical(self.location, {**secrets, **named})
        self.name = f"vcdask-store-credentials-{_key(self.location)}"

    def setup(self, worker: Any = None) -> None:
        """Register the credentials in this process."""
        remember(self.location, self.secrets)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.location!r} {' '.join(sorted(self.secrets))}>"


def _register_here(plugin: StoreCredentials) -> None:
    plugin.setup()


def share_credentials(
    client: Client, store_or_location: ParamStore | str, *, env: Mapping[str, str] | None = None, **secrets: str
) -> None:
    """Give the workers and the scheduler of ``client`` credentials for a store.

    Without ``secrets`` or ``env``, the secrets this process opened the store with are shared.
    They travel over the cluster's connections (use TLS on an untrusted network) and stay in the
    memory of the scheduler and the workers; they are never written into the store nor put in
    task arguments.  Prefer credentials the workers already have (environment, an AWS profile,
    an instance role) where you can: then nothing needs sharing.  They travel inside a
    :class:`StoreCredentials` plugin, which Dask's DEBUG logging (``distributed.core`` ...) may print;
    ``env`` sends only the names of environment variables.

    Parameters
    ----------
    client : distributed.Client
    store_or_location : ParamStore or str
        The store, or its location.
    env : mapping of str to str, optional
        Secret option -> environment variable to read it from on each worker and the scheduler.
    **secrets : str
        Secret options with their values (see :class:`StoreCredentials`).

    Raises
    ------
    ValueError
        No secrets given and none registered for the store in this process.
    InvalidLocationError
        A name that is not a secret option of the store's backend.

    Examples
    --------
    >>> share_credentials(client, store)  # doctest: +SKIP
    >>> check_cluster_access(store, client)  # doctest: +SKIP
    """
    location = _location(store_or_location)
    if not secrets and not env:
        secrets = remembered(location)
        if not secrets:
            raise ValueError(
                f"no credentials to share for {location!r}: none were given and this process has none registered "
                "(open the store with its secret options, or pass them here)"
            )
    plugin = StoreCredentials(location, env=env, **secrets)
    client.register_plugin(plugin)
    client.run_on_scheduler(_register_here, plugin)


async def _probe(payload: bytes) -> BaseException | None:
    """Unpickle a store here (as a task would) and read its main branch; the error, or None."""
    return await asyncio.to_thread(_probe_blocking, payload)


def _probe_blocking(payload: bytes) -> BaseException | None:
    try:
        store = pickle.loads(payload)
        store.head("main")
    except StoreError as e:
        return e
    except Exception as e:  # noqa: BLE001 - reported to the caller as data, naming the process that raised it
        return StoreError(redact(f"{type(e).__name__}: {e}"))
    return None


def _remedy(location: str) -> str:
    env = {
        "s3": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
        "gs": "GOOGLE_APPLICATION_CREDENTIALS",
        "gcs": "GOOGLE_APPLICATION_CREDENTIALS",
        "az": "AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_TOKEN)",
    }
    scheme = scheme_of(location)
    return (
        "A store never sends its secrets to other processes.  Give them credentials in one of these ways: "
        f"set {env.get(scheme, 'the provider credentials')} in the workers' and scheduler's environment; "
        "use an AWS profile or an instance role / workload identity the cluster's machines have; or call "
        "vcdask.store.share_credentials(client, store) to send this process's credentials to the cluster "
        "(they travel over its connections, so use TLS, and are never written into the store)."
    )


#: Seconds each worker has to say whether it can read a store (open it, read a branch's head).
ACCESS_SECONDS = 30.0


def check_cluster_access(store: ParamStore, client: Client, *, timeout: float = ACCESS_SECONDS) -> None:
    """Check that every worker and the scheduler of ``client`` can read ``store`` with their own credentials.

    Each process unpickles the store, as a task would (so without the secrets it was opened
    with here), and reads the head of its ``main`` branch.  Workers that join later are not checked, nor those
    that do not answer within ``timeout`` seconds (a frozen machine) or whose connection fails (one leaving):
    a warning names them, and the run goes on.

    Parameters
    ----------
    store : ParamStore
    client : distributed.Client
    timeout : float, default :data:`ACCESS_SECONDS`
        Seconds each worker has to answer.

    Raises
    ------
    StoreCredentialsError
        Some process has no credentials for the store, or they are refused; the message names
        the store, those processes and the remedies.
    StoreError
        Some process cannot read the store for another reason (e.g. the endpoint is unreachable from it).
    """
    from .._packages import ask_workers

    payload = pickle.dumps(store)
    found: dict[str, Any] = ask_workers(client, timeout, fn=_probe, args=(payload,))
    unknown = {where: e for where, e in found.items() if e is not None and not isinstance(e, StoreError)}
    if unknown:  # (no answer in time, a connection that failed: nothing known of them)
        logger.warning(
            "could not ask %d worker(s) whether they can read the store %s: %s",
            len(unknown),
            store.describe(),
            "; ".join(f"{w} ({e})" for w, e in sorted(unknown.items())),
        )
    found = {where: e for where, e in found.items() if where not in unknown}
    found["the scheduler"] = client.run_on_scheduler(_probe, payload)
    failed = {where: e for where, e in found.items() if e is not None}
    if not failed:
        return
    describe = store.describe()
    denied = {w: e for w, e in failed.items() if isinstance(e, StoreAccessDeniedError)}
    if denied:
        where, refused = next(iter(denied.items()))
        raise StoreCredentialsError(
            redact(
                f"{len(denied)} of {len(found)} processes of the cluster cannot read the store {describe} with their "
                f"own credentials: {', '.join(sorted(denied))} (first error, on {where}: {refused}).  "
                f"{_remedy(store.location)}"
            )
        )
    where, first = next(iter(failed.items()))
    raise StoreError(
        redact(
            f"{len(failed)} of {len(found)} processes of the cluster cannot read the store {describe}: "
            f"{', '.join(sorted(failed))} (first error, on {where}: {first})"
        )
    )
