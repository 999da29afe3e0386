"""The secrets this process holds for stores, by location, and the redaction of them from messages.

The registry behind :mod:`._credentials` (which fills it: :func:`~._credentials.register_credentials`,
the worker plugin :class:`~._credentials.StoreCredentials`): kept apart so that the modules that only
read it (error messages, side files, reopening a pickled store) need nothing else of the store.  This
module imports nothing of the store.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from ..errors import StoreCredentialsError

__all__ = ["forget_credentials", "lookup_credentials", "redact", "remember", "remembered"]

_registry: dict[str, dict[str, str | _EnvVar]] = {}
_lock = threading.Lock()
_MASK = "***"


class _EnvVar(str):
    """The name of an environment variable that holds a secret, read where the secret is used."""

    __slots__ = ()


def _key(location: str) -> str:
    return location.rstrip("/") or location


def remember(location: str, secrets: Mapping[str, str | _EnvVar]) -> None:
    """Use ``secrets`` in this process for the store at ``location``, replacing any held before.

    Parameters
    ----------
    location : str
        The store's location.
    secrets : mapping of str to str
        Secret options under their canonical names (checked by the caller); an :class:`_EnvVar`
        value names the environment variable to read the secret from where it is used.
    """
    with _lock:
        _registry[_key(location)] = dict(secrets)


def remembered(location: str) -> dict[str, str | _EnvVar]:
    """The secrets held for ``location`` in this process as they were given (environment variables unread).

    Parameters
    ----------
    location : str
        The store's location.

    Returns
    -------
    dict
        Secret option -> value or :class:`_EnvVar`; empty when none are held.
    """
    with _lock:
        return dict(_registry.get(_key(location), {}))


def forget_credentials(location: str) -> None:
    """Drop the secrets registered for ``location`` in this process (if any)."""
    with _lock:
        _registry.pop(_key(location), None)


def lookup_credentials(location: str) -> dict[str, str]:
    """The secrets registered for ``location`` in this process (empty when there are none).

    Raises
    ------
    StoreCredentialsError
        A secret was registered as an environment variable that this process does not have.
    """
    with _lock:
        found = dict(_registry.get(_key(location), {}))
    out = {}
    for name, value in found.items():
        if isinstance(value, _EnvVar):
            if str(value) not in os.environ:
                raise StoreCredentialsError(
                    f"the credentials for {location!r} name the environment variable {str(value)!r} for "
                    f"{name!r}, and this process (pid {os.getpid()}) has no such variable"
                )
            value = os.environ[str(value)]
        out[name] = str(value)
    return out


def redact(text: str) -> str:
    """``text`` with every secret registered in this process replaced by ``***``."""
    with _lock:
        values = {
            os.environ.get(v, "") if isinstance(v, _EnvVar) else v
            for secrets in _registry.values()
            for v in secrets.values()
        }
    for value in sorted(values, key=len, reverse=True):
        if isinstance(value, str) and len(value) >= 4:
            text = text.replace(value, _MASK)
    return text
