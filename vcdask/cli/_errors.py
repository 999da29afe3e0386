"""One line per failure: what went wrong and what to do, never a traceback (``--debug`` shows one)."""

from __future__ import annotations

import sys
import traceback

from ..errors import (
    InvalidLocationError,
    MissingRegionError,
    StoreAccessDeniedError,
    StoreNotFoundError,
    StoreUnreachableError,
    VersionNotFoundError,
)

__all__ = ["CommandError", "report"]

#: The command's exit codes: ok; failed (the store or the cluster failed, or something unexpected);
#: bad arguments or nothing there (no such store, branch, run or tag).
OK, FAILED, BAD_ARGUMENTS = 0, 1, 2

STORAGE_HINT = "--endpoint-url, --region, --anon or --storage-option KEY=VALUE"


class CommandError(Exception):
    """A failure the command explains itself: ``message`` is the whole line, ``code`` the exit code."""

    def __init__(self, message: str, code: int = BAD_ARGUMENTS):
        super().__init__(message)
        self.code = code


def missing_store(location: str, e: StoreNotFoundError) -> CommandError:
    """``no vcdask store at X (...)``: the remedy is on the command line, not ``mode='a'``.

    ``e.missing`` says what is missing: the store itself, the bucket (or container), or something else.
    """
    if "://" in location:
        detail = {"store": "", "bucket": ": the bucket does not exist"}.get(e.missing or "", f": {e}")
        return CommandError(f"no vcdask store at {location!r}{detail} (check the location, or {STORAGE_HINT})")
    if e.missing != "store":  # a file where the store should be, or a directory that is not a store
        return CommandError(f"{e} (check the path)")
    return CommandError(f"no vcdask store at {location!r} (check the path; object stores: s3://bucket/prefix)")


def missing_region(e: MissingRegionError) -> str:
    """The missing-region line with the command line's remedy (``--region REGION``)."""
    cause = f" ({e.cause})" if e.cause else ""
    return (
        f"{e.what or 'opening the store'}: no region is set for the bucket{cause}; give it: --region REGION "
        "(e.g. --region eu-west-1), or set AWS_REGION"
    )


def explain(e: BaseException) -> tuple[str, int]:
    """The line and exit code for an error raised by a command."""
    if isinstance(e, CommandError):
        return str(e), e.code
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    if isinstance(e, MissingRegionError):
        return missing_region(e), BAD_ARGUMENTS
    if isinstance(e, StoreAccessDeniedError):
        return f"{text} (check the credentials: AWS_ACCESS_KEY_ID / AWS_PROFILE ..., or --anon)", FAILED
    if isinstance(e, StoreUnreachableError):
        return f"{text} (check {STORAGE_HINT})", FAILED
    if isinstance(e, (InvalidLocationError, VersionNotFoundError, ValueError, KeyError)):
        return str(text), BAD_ARGUMENTS
    return f"{type(e).__name__}: {text} (--debug shows the traceback)", FAILED


def report(command: str, e: BaseException, *, debug: bool) -> int:
    """Print ``vcdask COMMAND: message`` on stderr (and the traceback with ``--debug``); return the exit code."""
    if debug:
        traceback.print_exception(e)
    line, code = explain(e)
    print(f"vcdask {command}: {line}", file=sys.stderr)
    return code
