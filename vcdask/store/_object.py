"""Object-storage backends: S3 (and S3-compatible), Google Cloud Storage, Azure Blob Storage.

Icechunk commits on object storage with conditional writes, so concurrent writers
need no lock of ours: the loser of a race gets a conflict and vcdask retries it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from ..errors import InvalidLocationError, StoreUnreachableError
from ._secret_options import has_userinfo, is_secret_config_key, mask_userinfo, userinfo_paths

__all__ = ["CONFIG_SECRET", "AzureBackend", "GCSBackend", "S3Backend", "is_secret_config_key"]

_ALIASES = {
    "key": "access_key_id",
    "secret": "secret_access_key",
    "token": "session_token",
    "region_name": "region",
    "endpoint": "endpoint_url",
}


def _split(location: str, what: str) -> tuple[str, str]:
    if has_userinfo(location):  # (its netloc would be the bucket, secret and all, and every message would show it)
        raise InvalidLocationError(
            f"the store location {mask_userinfo(location)!r} holds credentials before its {what} "
            f"(user:secret@{what}); a location is written into run specs, reports and messages: give the "
            f"credentials as the store's secret options (which never travel), in the environment or a profile, "
            f"and the location as {urlsplit(location).scheme}://{what}/prefix"
        )
    parts = urlsplit(location)
    if not parts.netloc:
        raise InvalidLocationError(f"{location!r} names no {what}; expected {parts.scheme}://{what}/prefix")
    return parts.netloc, parts.path.strip("/")


#: The prefix of the storage option that holds one secret entry of ``config`` (GCS, Azure): such an
#: entry is kept apart, as a secret option (``config.azure_client_secret``), so that it never travels.
#: Which entries are secrets: :func:`is_secret_config_key` (in :mod:`._secret_options`).
CONFIG_SECRET = "config."


def _split_config(location: str, opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` with the secret entries of ``config`` moved out of it, each to its own secret option."""
    config = opts.pop("config", None)
    if config is None:
        return opts
    if not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config):
        raise InvalidLocationError(
            f"the storage option config for {location!r} must be a mapping of object_store configuration keys "
            f"(str) to values, got {type(config).__name__}"
        )
    public = {k: v for k, v in config.items() if not is_secret_config_key(k)}
    if public:
        opts["config"] = public
    opts.update({CONFIG_SECRET + k: v for k, v in config.items() if is_secret_config_key(k)})
    return opts


def _joined_config(options: dict[str, Any]) -> dict[str, Any]:
    """The options for Icechunk: the secret entries of ``config`` back inside it."""
    out = {k: v for k, v in options.items() if not k.startswith(CONFIG_SECRET)}
    secret = {k[len(CONFIG_SECRET) :]: v for k, v in options.items() if k.startswith(CONFIG_SECRET)}
    if secret:
        out["config"] = {**out.get("config", {}), **secret}
    return out


def _check_options(location: str, options: dict[str, Any], valid: set[str]) -> dict[str, Any]:
    with_userinfo = userinfo_paths(options)
    if with_userinfo:  # (an endpoint is public: it is pickled with the store and shown by describe())
        raise InvalidLocationError(
            f"the storage option(s) {with_userinfo} for {location!r} are URLs with credentials in them "
            "(user:secret@host): endpoints travel with the store and appear in its messages; give the "
            "credentials as the store's secret options, in the environment or a profile, and the URL without them"
        )
    out = {_ALIASES.get(k, k): v for k, v in options.items()}
    unknown = sorted(
        k
        for k in set(out) - valid
        # a secret entry of config, kept apart (a pickled copy gets it back from the credential registry)
        if not ("config" in valid and k.startswith(CONFIG_SECRET) and is_secret_config_key(k[len(CONFIG_SECRET) :]))
    )
    if unknown:
        raise InvalidLocationError(
            f"unknown storage option(s) {unknown} for {location!r}; valid options: {sorted(valid)}"
        )
    return out


class _ObjectBackend:
    shared_across_processes = True
    durable = True
    locked_commits = False  # the service arbitrates commits: a collection cannot hold other writers off
    # GCS and Azure: Icechunk's own retries (not measured here: no emulator in the tests)
    client_per_storage = False
    #: Options that are secrets: never pickled, logged or written into the store.
    secret_options: frozenset[str] = frozenset()
    location: str
    options: dict[str, Any]

    def describe(self) -> str:
        return repr(self.location)

    def preflight(self, mode: str) -> None:
        return None

    def check_creatable(self) -> None:
        return None

    def commit_lock(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def create_lock(self) -> contextlib.AbstractContextManager[None]:
        # Creation is arbitrated by the service's conditional writes; the store reopens what a winner created.
        return contextlib.nullcontext()


class S3Backend(_ObjectBackend):
    """``s3://bucket/prefix`` on AWS or any S3-compatible service (MinIO, Ceph, moto, R2 ...)."""

    scheme = "s3"
    client_per_storage = True  # the AWS SDK's client, built at the first request (_repository._with_its_own_client)
    secret_options = frozenset({"access_key_id", "secret_access_key", "session_token"})
    valid_options = {
        "endpoint_url",
        "region",
        "allow_http",
        "force_path_style",
        "access_key_id",
        "secret_access_key",
        "session_token",
        "anonymous",
        "client_kwargs",
        "network_stream_timeout_seconds",
    }

    def __init__(self, location: str, options: dict[str, Any]):
        self.location = location
        self.bucket, self.prefix = _split(location, "bucket")
        opts = _check_options(location, options, self.valid_options)
        client_kwargs = opts.pop("client_kwargs", None) or {}
        for k, v in client_kwargs.items():  # the s3fs spelling: client_kwargs={"endpoint_url": ...}
            k = _ALIASES.get(k, k)
            if k not in ("endpoint_url", "region"):
                raise InvalidLocationError(
                    f"unsupported client_kwargs entry {k!r} for {location!r}; valid: ['endpoint_url', 'region_name']"
                )
            opts.setdefault(k, v)
        endpoint = opts.get("endpoint_url")
        if endpoint is not None:
            opts.setdefault("allow_http", str(endpoint).startswith("http://"))
            opts.setdefault("force_path_style", True)
            opts.setdefault("region", "us-east-1")
        self.options = opts

    def describe(self) -> str:
        where = f" at {self.options['endpoint_url']}" if "endpoint_url" in self.options else ""
        return f"{self.location!r}{where}"

    def preflight(self, mode: str) -> None:
        """Fail fast on a custom endpoint that refuses connections.

        The storage client retries a refused connection for tens of seconds before it
        gives up; one TCP connect tells the user at once.
        """
        endpoint = self.options.get("endpoint_url")
        if not endpoint:
            return
        parts = urlsplit(str(endpoint))
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname, port), timeout=10).close()
        except OSError as e:
            raise StoreUnreachableError(
                f"opening {self.describe()}: the storage endpoint could not be reached ({e.strerror or e})"
            ) from None

    def filesystem(self, max_tries: int = 5, *, asynchronous: bool = False):
        """An s3fs filesystem with the same endpoint and credentials, and the store's root path."""
        import s3fs

        o = self.options
        client_kwargs = {k2: o[k] for k, k2 in (("endpoint_url", "endpoint_url"), ("region", "region_name")) if k in o}
        # s3fs and botocore each retry; together they held a failing request for ~40 s in a
        # store outage.  One layer of retries (s3fs's, with backoff) is enough.
        kwargs: dict[str, Any] = {
            "client_kwargs": client_kwargs,
            "use_listings_cache": False,
            "asynchronous": asynchronous,
            "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}},
        }
        if o.get("force_path_style"):
            kwargs["config_kwargs"]["s3"] = {"addressing_style": "path"}
        for k, k2 in (
            ("access_key_id", "key"),
            ("secret_access_key", "secret"),
            ("session_token", "token"),
            ("anonymous", "anon"),
        ):
            if k in o:
                kwargs[k2] = o[k]
        fs = s3fs.S3FileSystem(**kwargs)
        fs.retries = max_tries  # s3fs's attempts per request (a class attribute, default 5)
        return fs, f"{self.bucket}/{self.prefix}".rstrip("/")

    def storage(self):
        import icechunk

        opts = dict(self.options)
        if not any(k in opts for k in ("access_key_id", "anonymous")):
            opts["from_env"] = True  # the standard AWS credential chain
        return icechunk.s3_storage(bucket=self.bucket, prefix=self.prefix or None, **opts)


class GCSBackend(_ObjectBackend):
    """``gs://bucket/prefix`` (also ``gcs://``) on Google Cloud Storage."""

    scheme = "gs"
    secret_options = frozenset({"service_account_key", "bearer_token"})
    valid_options = {
        "service_account_file",
        "service_account_key",
        "application_credentials",
        "bearer_token",
        "anonymous",
        "config",
    }

    def __init__(self, location: str, options: dict[str, Any]):
        self.location = location
        self.bucket, self.prefix = _split(location, "bucket")
        self.options = _split_config(location, _check_options(location, options, self.valid_options))
        self.secret_options = type(self).secret_options | {k for k in self.options if k.startswith(CONFIG_SECRET)}

    def filesystem_kwargs(self) -> dict[str, Any]:
        """The credentials for gcsfs (``GCSFileSystem(token=...)``), from the store's options.

        A service-account key (JSON text) becomes its dict, a bearer token a ``google.auth`` credential
        (gcsfs takes a file path, a dict or a credential); none of them: gcsfs's own chain.
        """
        o = self.options
        token: Any = None
        if o.get("anonymous"):
            token = "anon"
        elif "service_account_key" in o:
            token = json.loads(o["service_account_key"])
        elif "bearer_token" in o:
            from google.oauth2.credentials import Credentials  # gcsfs depends on google-auth

            token = Credentials(token=o["bearer_token"])
        else:
            token = o.get("service_account_file") or o.get("application_credentials")
        return {"token": token}

    def filesystem(self, max_tries: int = 5, *, asynchronous: bool = False):
        """A gcsfs filesystem (install gcsfs) with the store's credentials, and the store's root path."""
        try:
            import gcsfs
        except ImportError:
            raise ImportError("side files on gs:// need gcsfs: pip install gcsfs") from None
        fs = gcsfs.GCSFileSystem(asynchronous=asynchronous, **self.filesystem_kwargs())
        return fs, f"{self.bucket}/{self.prefix}".rstrip("/")

    def storage(self):
        import icechunk

        opts = _joined_config(self.options)
        if not opts:
            opts["from_env"] = True
        return icechunk.gcs_storage(bucket=self.bucket, prefix=self.prefix or None, **opts)


class AzureBackend(_ObjectBackend):
    """``az://container/prefix`` (also ``abfs://``) on Azure Blob Storage; needs ``account``."""

    scheme = "az"
    secret_options = frozenset({"access_key", "sas_token", "bearer_token"})
    valid_options = {"account", "access_key", "sas_token", "bearer_token", "config"}

    def __init__(self, location: str, options: dict[str, Any]):
        self.location = location
        self.container, self.prefix = _split(location, "container")
        self.options = _split_config(location, _check_options(location, options, self.valid_options))
        self.secret_options = type(self).secret_options | {k for k in self.options if k.startswith(CONFIG_SECRET)}
        if "account" not in self.options:
            raise InvalidLocationError(
                f"Azure location {location!r} needs the storage option account='<storage account name>'"
            )

    def filesystem_kwargs(self) -> dict[str, Any]:
        """The account and credentials for adlfs (``AzureBlobFileSystem(...)``), from the store's options.

        A bearer token becomes a token credential (adlfs takes ``credential=``); none of them: adlfs's chain.
        """
        o = self.options
        kwargs: dict[str, Any] = {"account_name": o["account"]}
        if "access_key" in o:
            kwargs["account_key"] = o["access_key"]
        if "sas_token" in o:
            kwargs["sas_token"] = o["sas_token"]
        if "bearer_token" in o:
            kwargs["credential"] = StaticTokenCredential(o["bearer_token"])
        return kwargs

    def filesystem(self, max_tries: int = 5, *, asynchronous: bool = False):
        """An adlfs filesystem (install adlfs) with the store's credentials, and the store's root path."""
        try:
            import adlfs
        except ImportError:
            raise ImportError("side files on az:// need adlfs: pip install adlfs") from None
        fs = adlfs.AzureBlobFileSystem(asynchronous=asynchronous, **self.filesystem_kwargs())
        return fs, f"{self.container}/{self.prefix}".rstrip("/")

    def storage(self):
        import icechunk

        opts = _joined_config(self.options)
        account = opts.pop("account")
        if not any(k in opts for k in ("access_key", "sas_token", "bearer_token")):
            opts["from_env"] = True
        return icechunk.azure_storage(account=account, container=self.container, prefix=self.prefix, **opts)


class AccessToken(NamedTuple):
    """A bearer token as the Azure SDK reads one (``azure.core.credentials.AccessToken``'s fields)."""

    token: str
    expires_on: int


class StaticTokenCredential:
    """An Azure token credential (async, as adlfs uses) that always gives the one bearer token it holds.

    The token is not renewed (as for Icechunk's own ``bearer_token``): once it expires, requests are refused.
    """

    def __init__(self, token: str):
        self._token = token

    async def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        return AccessToken(self._token, int(time.time()) + 365 * 24 * 3600)

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> StaticTokenCredential:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} ***>"
