"""Turn Icechunk's errors into vcdask's, with a message that names what was asked for."""

from __future__ import annotations

import os
import re

from ..errors import (
    BranchExistsError,
    MissingRegionError,
    StoreAccessDeniedError,
    StoreConflict,
    StoreError,
    StoreNotFoundError,
    StoreUnreachableError,
    TagExistsError,
    VersionNotFoundError,
)
from ._secrets import redact

_ACCESS = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "ExpiredToken",
    "Forbidden",
    "InvalidClientTokenId",
    "AuthorizationHeaderMalformed",
    "PermissionDenied",
)
# HTTP 403 as a status code on its own: not the digits inside a longer token, such as a run id stamped 00:24:03
# ("run-20261125-002403-4e2050"), which every message about that run's branch contains.
_STATUS_403 = re.compile(r"(?<![\w-])403(?![\w-])")
_UNREACHABLE = (
    "dispatch failure",
    "Connection refused",
    "tcp connect",
    "timed out",
    "timeout",
    "dns error",
    "failed to lookup address",
    "Connection reset",
    "connection closed",
)
_NOT_FOUND = (
    "NoSuchBucket",
    "NoSuchKey",
    "object not found",
    "No data in memory found",
    "ContainerNotFound",
    "bucket does not exist",
    "repository doesn't exist",
    "No such file or directory",
)
# No region for an S3 bucket (the SDK says so only at the end, after failing to find one in instance metadata).
_NO_REGION = ("A region must be set", "failed to load region", "no region")

#: Icechunk's Rust log filter while the user has not set ``ICECHUNK_LOG``: its own warnings, and none of the
#: AWS SDK's (a missing region prints three blocks of them before the error, which vcdask names itself).
QUIET_LOGS = "icechunk=warn,icechunk::storage::object_store=error"
_quieted = False


def quiet_logs() -> None:
    """Keep the storage SDKs' Rust log noise out of the terminal, unless the user set ``ICECHUNK_LOG``.

    Icechunk prints its Rust tracing (and the AWS SDK's, e.g. one warning per failed attempt to find a
    region in instance metadata) to stderr at level ``warn``; vcdask turns those failures into errors
    that name the cause (:func:`translate`).  ``ICECHUNK_LOG=debug`` (or any filter) still shows them all.
    """
    global _quieted
    if _quieted or "ICECHUNK_LOG" in os.environ:
        return
    import icechunk

    icechunk.set_logs_filter(QUIET_LOGS)
    _quieted = True


# The provider's credential chain found nothing (checked before _UNREACHABLE: the SDK calls it a "dispatch failure").
_NO_CREDENTIALS = (
    "no providers in chain provided credentials",
    "credential provider was not enabled",
    "Unable to locate credentials",
    "could not load credentials",
    "NoCredentialProviders",
    "IMDS is disabled or the caller has insufficient permissions",  # the chain ended at instance metadata
    "failed to load IMDS session token",
)


def root_cause(exc: BaseException) -> str:
    """The innermost cause in an Icechunk error report (its last ``-> ...`` line), or its first line."""
    text = str(exc)
    causes = re.findall(r"(?:\|->|`->)\s*(.+)", text)
    if causes:
        return causes[-1].strip()
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first.lstrip("x ").strip()


def translate(exc: BaseException, what: str) -> Exception:
    """A vcdask error for ``exc``; ``what`` says what was being done ("opening 's3://b/p'").

    The message never shows a secret registered in this process (see :func:`._secrets.redact`).
    """
    err = _translate(exc, what)
    err.args = (redact(str(err.args[0])),)
    return err


def _translate(exc: BaseException, what: str) -> Exception:
    import icechunk

    text = str(exc)
    cause = root_cause(exc)
    if isinstance(exc, icechunk.ConflictError):
        return StoreConflict(f"{what}: another writer committed first ({cause})")
    if any(k in text for k in _NO_CREDENTIALS):
        return StoreAccessDeniedError(
            f"{what}: no credentials: none were given, and the provider's standard chain (environment, "
            f"profile, instance role) found none in this process ({cause})"
        )
    if any(k in text for k in _NO_REGION):
        return MissingRegionError(
            f"{what}: no region is set for the bucket ({cause.rstrip('.')}). Give the bucket's region: "
            "open_store(location, region='eu-west-1') (region= in the store's storage options, "
            "storage_options={'region': ...}), or the AWS_REGION environment variable (or a profile's region)",
            what=what,
            cause=redact(cause.rstrip(".")),
        )
    if any(k in text for k in _ACCESS) or _STATUS_403.search(text):
        return StoreAccessDeniedError(f"{what}: access denied by the storage service ({cause})")
    if "NoSuchBucket" in text or "ContainerNotFound" in text:
        return StoreNotFoundError(f"{what}: the bucket or container does not exist ({cause})", missing="bucket")
    if any(k in text for k in _UNREACHABLE):
        return StoreUnreachableError(f"{what}: the storage endpoint could not be reached ({cause})")
    if "snapshot not found" in text or "invalid snapshot id" in text or "ref not found" in text:
        return VersionNotFoundError(f"{what}: not found ({cause})")
    if "tags are immutable" in text or "tag already exists" in text:
        return TagExistsError(f"{what}: the tag already exists and tags are immutable")
    if "branch already exists" in text:
        return BranchExistsError(f"{what}: the branch already exists")
    if any(k in text for k in _NOT_FOUND):
        return StoreNotFoundError(f"{what}: not found ({cause})")
    return StoreError(f"{what}: {cause}")


def ref_error(repo, where: str, e: Exception, *, version=None, tag=None, branch=None) -> Exception:
    """The vcdask error for a failed lookup of a version, tag or branch of ``repo`` (at ``where``, in words)."""
    import icechunk

    err = translate(e, f"reading {where}")
    if not isinstance(err, (VersionNotFoundError, StoreNotFoundError)):
        return err
    # Icechunk reports "snapshot not found" also when fetching the snapshot failed (e.g. the
    # object store answered 503 past its retries): only a store that answers can say "no such".
    try:
        repo.lookup_branch("main")
    except icechunk.IcechunkError as probe:
        fault = translate(probe, f"reading {where}")
        if not isinstance(fault, (VersionNotFoundError, StoreNotFoundError)):
            return fault
    if tag is not None:
        return VersionNotFoundError(f"no tag {tag!r} in {where}; tags: {sorted(repo.list_tags())}")
    if version is not None:
        return VersionNotFoundError(f"no version {version!r} in {where}")
    branches = sorted(b for b in repo.list_branches() if not b.startswith(("vcdask.keep.", "vcdask.hold.")))
    return VersionNotFoundError(f"no branch {branch!r} in {where}; branches: {branches}")
