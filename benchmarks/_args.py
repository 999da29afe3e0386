"""Checks of the benchmarks' list-valued options, run right after argument parsing (before any cluster starts).

Each helper parses one option's text and, for a bad value, ends the program through ``ap.error`` (exit status 2)
with a message that names the option, the bad value and what it accepts, as argparse does for ``choices``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def choices_list(
    ap: argparse.ArgumentParser, option: str, text: str, choices: Iterable[str], allow_empty: bool = False
) -> list[str]:
    """``text`` split at commas, each item one of ``choices``; at least one item unless ``allow_empty``."""
    valid = list(choices)
    items = [s for s in text.split(",") if s] if allow_empty else text.split(",")
    unknown = [s for s in items if s not in valid]
    if unknown:
        ap.error(f"{option}: unknown {unknown}; choose from {valid}")
    return items


def number_list(
    ap: argparse.ArgumentParser,
    option: str,
    text: str,
    kind: Callable[[str], float],
    minimum: float | None = None,
    maximum: float | None = None,
    words: Iterable[str] = (),
    one: bool = False,
) -> list:
    """``text`` split at commas, each item a number (``kind``: int or float) in ``[minimum, maximum]`` or one of
    ``words`` (kept as text); ``one``: a single item."""
    words = list(words)
    what = "an integer" if kind is int else "a number"
    if minimum is not None and maximum is not None:
        what += f" in [{minimum}, {maximum}]"
    elif minimum is not None:
        what += f" >= {minimum}"
    elif maximum is not None:
        what += f" <= {maximum}"
    if words:
        what = f"{', '.join(words)} or {what}"
    if one and "," in text:
        ap.error(f"{option} takes one value, {what}; got {text!r}")
    values: list = []
    for item in text.split(","):
        if item in words:
            values.append(item)
            continue
        try:
            value = kind(item)
        except ValueError:
            value = None
        if (
            value is None
            or value != value  # nan
            or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)
        ):
            each = "it must be" if one else "each item of its comma list must be"
            ap.error(f"{option}: got {item!r}; {each} {what}")
        values.append(value)
    return values


def one_number(
    ap: argparse.ArgumentParser,
    option: str,
    text: str,
    kind: Callable[[str], float],
    minimum: float | None = None,
    maximum: float | None = None,
    words: Iterable[str] = (),
):
    """``text`` as one value, read as :func:`number_list` reads each item."""
    return number_list(ap, option, text, kind, minimum, maximum, words, one=True)[0]
