"""What counts as a secret among storage options, and URLs that carry credentials: one definition for the
store's options (:mod:`._object`, :mod:`._credentials`) and for the data's (:mod:`vcdask.data`).

A secret is found by the name that holds it (``secret``, ``client_kwargs.aws_secret_access_key``,
``headers.Authorization``), never by its value, and reported by that name only: messages never echo a
value that may be one.  A URL with credentials in it (``s3://KEY:SECRET@bucket/...``) is shown masked
(:func:`mask_userinfo`).  This module imports nothing of the store.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "FSSPEC_SECRET_OPTIONS",
    "SECRET_HEADERS",
    "has_userinfo",
    "is_secret_config_key",
    "is_secret_option",
    "mask_userinfo",
    "secret_paths",
    "secret_query",
    "userinfo_paths",
]

#: fsspec storage-option names that carry a secret (s3fs, gcsfs, adlfs and HTTP spellings, botocore's names).
FSSPEC_SECRET_OPTIONS = frozenset(
    {
        "key",
        "secret",
        "token",
        "access_key_id",
        "secret_access_key",
        "session_token",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "access_key",
        "account_key",
        "sas_token",
        "client_secret",
        "password",
        "passwd",
        "credential",
        "credentials",
        "connection_string",
        "bearer_token",
        "service_account_key",
        "api_key",
        "access_token",
        "refresh_token",
        "private_key",
        # S3 server-side encryption with a key of the caller's (s3fs's s3_additional_kwargs, botocore's names)
        "ssecustomerkey",
        "copysourcessecustomerkey",
        "sse_customer_key",
        "copy_source_sse_customer_key",
    }
)
#: HTTP headers that carry a secret (lower-case; fsspec's HTTP filesystem takes ``headers={...}``).
SECRET_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "cookie",
        "x-amz-security-token",
        "x-api-key",
        "x-auth-token",
        "x-goog-api-key",
    }
)
#: A configuration key (object_store's ``config``, a header ``x-...``) holding one of these words is a secret ...
_SECRET_WORDS = ("key", "secret", "token", "sas", "password", "credential")
#: ... except these, which name a file (they travel, as ``service_account_file`` does).
_FILE_KEYS = frozenset({"google_application_credentials", "azure_federated_token_file", "federated_token_file"})
#: Prefixes of names that follow the word rule: object_store's keys (``google_service_account_key``,
#: ``azure_storage_account_key`` ...) and custom HTTP headers.
_WORD_RULE_PREFIXES = ("aws_", "google_", "azure_", "x-", "x_")
#: ``scheme://`` at the start of a URL (one part of a chained URL, ``simplecache::s3://...``).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def is_secret_config_key(key: str) -> bool:
    """Whether the ``config`` entry ``key`` (an object_store configuration key) holds a secret.

    The rule: a key whose name holds ``key``, ``secret``, ``token``, ``sas``, ``password`` or ``credential``
    is a secret, unless it names a file (``google_application_credentials``, ``azure_federated_token_file``) or
    the KMS key that encrypts the objects (``aws_sse_kms_key_id``, a header ``...-aws-kms-key-id``).
    """
    k = key.lower()
    if ("kms" in k or "encryption" in k) and k.endswith(("key_id", "key-id", "keyid", "key_arn", "key-arn")):
        return False  # (which KMS key encrypts the objects: an identifier, x-amz-server-side-encryption-aws-kms-key-id)
    return k not in _FILE_KEYS and any(word in k for word in _SECRET_WORDS)


def is_secret_option(name: str) -> bool:
    """Whether a storage option (at any depth of the options) named ``name`` holds a secret.

    One of :data:`FSSPEC_SECRET_OPTIONS` (any case, ``-`` or ``_``), a header of :data:`SECRET_HEADERS`, or a
    name of object_store's (``aws_``, ``google_``, ``azure_``) or a custom header (``x-``) that the rule of
    :func:`is_secret_config_key` calls a secret.
    """
    n = name.lower()
    if n in SECRET_HEADERS or n.replace("-", "_") in FSSPEC_SECRET_OPTIONS:
        return True
    return n.startswith(_WORD_RULE_PREFIXES) and is_secret_config_key(n)


#: Schemes whose ``name@host`` names a container or a user, not a credential (a ``name:password@`` still is).
NAMED_USERINFO = frozenset({"abfs", "abfss", "az", "adl", "sftp", "ssh"})


def has_userinfo(url: str) -> bool:
    """Whether ``url`` (or a part of a chained URL) carries credentials before its host: ``user:password@``.

    Also a netloc with a colon not followed by a port only (``s3://KEY:SEC/RET@bucket``: a secret holding a
    ``/`` cuts the netloc short of its ``@``).  A name alone before the ``@`` is one (``https://TOKEN@host``), but
    for the schemes where it names a container or a user (:data:`NAMED_USERINFO`: ``abfs://container@account...``,
    ``sftp://alice@host``).
    """
    for part in url.split("::"):
        m = _SCHEME.match(part)
        if m is None:
            continue
        netloc = re.split(r"[/?#]", part[m.end() :], maxsplit=1)[0]
        named = m.group(1).lower() in NAMED_USERINFO
        if "@" in netloc and (not named or ":" in netloc.rpartition("@")[0]):
            return True
        host, colon, port = netloc.rpartition(":")
        if colon and not (port.isdigit() or port == "" or host.endswith("]") or netloc.endswith("]")):
            return True
    return False


def mask_userinfo(url: str) -> str:
    """``url`` with the credentials of each part that has some (:func:`has_userinfo`) masked:
    ``s3://***@bucket/prefix``; everything after the scheme up to the part's last ``@`` is masked (all of it when
    there is no ``@``)."""
    out = []
    for part in url.split("::"):
        m = _SCHEME.match(part)
        if m is not None and has_userinfo(part):
            rest = part[m.end() :]
            part = f"{m.group(0)}***@{rest.rsplit('@', 1)[1]}" if "@" in rest else f"{m.group(0)}***"
        out.append(part)
    return "::".join(out)


def _walk(options: Any, prefix: str):
    """(dotted path, name, value) of every entry of ``options``: nested mappings and lists walked."""
    if isinstance(options, Mapping):
        items = ((str(k), k, v) for k, v in options.items())
    elif isinstance(options, (list, tuple)):
        items = ((str(i), None, v) for i, v in enumerate(options))
    else:
        return
    for key, name, value in items:
        path = f"{prefix}.{key}" if prefix else key
        yield path, name, value
        yield from _walk(value, path)


def userinfo_paths(options: Any, prefix: str = "") -> list[str]:
    """The dotted paths of the values of ``options`` (nested mappings and lists too) that are URLs with
    credentials in them (:func:`has_userinfo`): ``["client_kwargs.endpoint_url"]``."""
    return [path for path, _, value in _walk(options, prefix) if isinstance(value, str) and has_userinfo(value)]


def secret_paths(options: Any, prefix: str = "") -> list[str]:
    """The dotted paths, sorted, of the entries of ``options`` that hold a secret: by their names
    (:func:`is_secret_option`, at any depth: ``client_kwargs.aws_secret_access_key``, ``s3.secret``,
    ``headers.Authorization``, ``s3_additional_kwargs.SSECustomerKey``), a header given as a ``(name, value)``
    pair, and URLs with credentials in them (:func:`userinfo_paths`).  Never their values.
    """
    found = set(userinfo_paths(options, prefix))
    for path, name, value in _walk(options, prefix):
        if isinstance(name, str) and is_secret_option(name):
            found.add(path)
        pair = isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str)
        if pair and value[0].lower() in SECRET_HEADERS:
            found.add(f"{path}.{value[0]}")
    # (an entry inside a secret one is named by the outer one only)
    return sorted(p for p in found if not any(p.startswith(q + ".") for q in found))


#: Query parameters of a URL that carry a secret: a signed URL's signature and credentials (S3 presigned, GCS
#: signed, an Azure SAS's ``sig``), a token or a key.
SECRET_QUERY = frozenset(
    {
        "sig",
        "signature",
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "x-goog-signature",
        "x-goog-credential",
        "token",
        "access_token",
        "api_key",
        "apikey",
        "key",
        "password",
    }
)


def secret_query(url: str) -> list[str]:
    """The names of ``url``'s query parameters (any part of a chained URL) that carry a secret
    (:data:`SECRET_QUERY`), never their values: ``["sig"]`` for an Azure SAS URL."""
    from urllib.parse import parse_qsl, urlsplit

    names: list[str] = []
    for part in url.split("::"):
        if _SCHEME.match(part):
            query = parse_qsl(urlsplit(part).query, keep_blank_values=True)
            names += [k for k, _ in query if k.lower() in SECRET_QUERY]
    return names
