"""A store's settings (``chunk_bytes``, ``commit_retries``, ``max_tries``), checked before anything is
opened, and a hold's time to live, checked.

Each setting comes from :func:`vcdask.open_store`'s argument or, when that is None, from
``dask.config`` (``vcdask.store.*``: the package's ``vcdask.yaml``, the user's files, ``DASK_VCDASK__STORE__*``
environment variables).  A bad value raises, naming where it came from, the value and what is valid.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .. import config
from ..errors import InvalidLocationError

__all__ = ["StoreSettings", "check_ttl", "resolve_settings"]


class StoreSettings(NamedTuple):
    """A store's checked settings (see :func:`vcdask.open_store`)."""

    chunk_bytes: int
    commit_retries: int
    max_tries: int


def resolve_settings(chunk_bytes: Any = None, commit_retries: Any = None, max_tries: Any = None) -> StoreSettings:
    """The settings a store opens with: each argument, or its ``vcdask.store.*`` config value when None.

    ``chunk_bytes`` may also be a byte string in Dask's spelling (``"4MiB"``, ``"8 MB"``).

    Raises
    ------
    TypeError
        A setting that is not an integer (``chunk_bytes=2.5``, ``max_tries="3"``, ``True``), or a
        ``chunk_bytes`` string that is not a size.
    InvalidLocationError
        An integer out of range: ``chunk_bytes`` < 1, ``commit_retries`` < 0, ``max_tries`` < 1
        (a ``ValueError``).
    """
    return StoreSettings(
        chunk_bytes=_setting("chunk_bytes", "chunk-bytes", chunk_bytes, 1, sizes=True),
        commit_retries=_setting("commit_retries", "commit-retries", commit_retries, 0),
        max_tries=_setting("max_tries", "max-tries", max_tries, 1),
    )


def _setting(name: str, key: str, value: Any, minimum: int, *, sizes: bool = False) -> int:
    where = name
    if value is None:
        value, where = config.get(f"store.{key}"), f"the config value vcdask.store.{key}"
    valid = f"an integer >= {minimum}" + (' or a size such as "4MiB"' if sizes else "")
    message = f"{where} must be {valid}, got {value!r}"
    if sizes and isinstance(value, str):
        from dask.utils import parse_bytes

        try:
            value = parse_bytes(value)
        except (ValueError, TypeError):
            raise TypeError(message) from None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(message)
    if value < minimum:
        raise InvalidLocationError(message)
    return int(value)


def check_ttl(ttl: Any) -> float:
    """``ttl`` (seconds a hold lasts, see :meth:`vcdask.store.ParamStore.hold`) as a float, once checked.

    Raises
    ------
    TypeError
        Not a real number (``"1h"``, ``None``, ``True``).
    ValueError
        Not finite, or not above zero: a hold that ends before it starts keeps nothing.
    """
    message = f"ttl must be a finite number of seconds > 0, got {ttl!r}"
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float, np.integer, np.floating)):
        raise TypeError(message)
    if not math.isfinite(ttl) or ttl <= 0:
        raise ValueError(message)
    return float(ttl)
