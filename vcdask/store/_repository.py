"""Open or create a store's Icechunk repository, also when several threads or processes create it at once.

Creating is serialised where the backend can lock (a local directory: its file lock; memory: a
process lock).  On object storage the service arbitrates with conditional writes: a creator
that loses waits until the winner's repository is there and opens it.  Either way every
opener of a new location ends up with the same, single repository.

An existing repository opens only if it is a vcdask store (:func:`check_is_store`): another
Icechunk repository (a user's dataset) is refused, never written to or collected.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import TYPE_CHECKING

from ..errors import StoreExistsError, StoreNotFoundError
from ._errors import translate
from ._layout import is_version

if TYPE_CHECKING:
    import icechunk

    from ._backend import StoreBackend

logger = logging.getLogger(__name__)

#: How long a creator that lost the race waits for the winner's repository to appear (seconds).
CREATE_RACE_WAIT = 30.0
# What Icechunk says when another creator wrote to the location first.
_RACE_SIGNS = (
    "can only be created in clean prefixes",
    "updated by other session",
    "already exists",
    "File exists",
    "branch update conflict",  # S3: the main branch's first commit was written by another creator
)


def open_repository(backend: StoreBackend, mode: str, max_tries: int) -> icechunk.Repository:
    """Open the repository at ``backend``'s location, creating it when ``mode`` allows.

    Raises
    ------
    StoreExistsError
        ``mode="w-"`` and a store exists there (or another opener created it first).
    StoreNotFoundError
        ``mode="r"``/``"r+"`` and no store exists there, the bucket does not exist, or the repository
        there is not a vcdask store (see :func:`check_is_store`).
    StoreError
        Any other storage fault (translated, see :func:`._errors.translate`).
    """
    import icechunk

    what = f"opening {backend.describe()}"
    config = icechunk.RepositoryConfig(
        storage=icechunk.StorageSettings(retries=icechunk.StorageRetriesSettings(max_tries=max_tries))
    )
    backend.preflight(mode)
    try:
        storage = backend.storage()
        exists = icechunk.Repository.exists(storage)
    except icechunk.IcechunkError as e:
        raise translate(e, what) from None
    if not exists and mode in ("r", "r+"):
        raise StoreNotFoundError(
            f"no vcdask store at {backend.describe()} (mode={mode!r} opens existing stores only; "
            "use mode='a' to create one)",
            location=backend.describe(),
            mode=mode,
        )
    if not exists:
        with backend.create_lock():
            repo = _create(backend, storage, config, mode, what)
    elif mode == "w-":
        raise _exists_error(backend)
    else:
        repo = _open(backend, storage, config, what)
    return _with_its_own_client(repo) if backend.client_per_storage else repo


def _with_its_own_client(repo: icechunk.Repository) -> icechunk.Repository:
    """``repo`` on a storage whose client is built with ``repo``'s own storage settings (its retries).

    Icechunk (1.1) builds an object store's client at the storage's first request and keeps it: a
    repository is found and opened with the default settings (10 tries a request, backing off up to
    180 s), so its config's retries were never applied (earth-mover/icechunk#2342); against a store
    answering 503, one request took 19-50 s to fail whatever ``max_tries`` said.  A copy made through
    pickle, in memory, has a storage without a client yet, and the copy's first request builds one
    with the copy's config.  (The copy's credentials are the original's; nothing leaves the process.)
    """
    return pickle.loads(pickle.dumps(repo))


def _create(
    backend: StoreBackend, storage: icechunk.Storage, config: icechunk.RepositoryConfig, mode: str, what: str
) -> icechunk.Repository:
    """Create the repository (holding the backend's create lock), or open the one another opener made."""
    import icechunk

    try:
        exists = icechunk.Repository.exists(storage)  # another creator may have finished while we waited
    except icechunk.IcechunkError as e:
        raise translate(e, what) from None
    if exists:
        if mode == "w-":
            raise _exists_error(backend)
        return _open(backend, storage, config, what)
    backend.check_creatable()
    try:
        repo = icechunk.Repository.create(storage, config=config)
    except icechunk.IcechunkError as e:
        if not _lost_race(e) or not _wait_until_exists(storage):
            raise translate(e, what) from None
        logger.debug("%s: another opener created the store first; opening theirs", what)
        if mode == "w-":
            raise _exists_error(backend) from None
        return _open(backend, storage, config, what)
    logger.info("created a new vcdask store at %s", backend.describe())
    return repo


def _lost_race(exc: Exception) -> bool:
    """Whether a failed create says that another creator wrote to the same location first."""
    import icechunk

    text = str(exc)
    return isinstance(exc, icechunk.ConflictError) or any(sign in text for sign in _RACE_SIGNS)


def _wait_until_exists(storage: icechunk.Storage) -> bool:
    """Whether a repository appears at ``storage`` within :data:`CREATE_RACE_WAIT` seconds."""
    import icechunk

    deadline = time.monotonic() + CREATE_RACE_WAIT
    delay = 0.02
    while True:
        try:
            if icechunk.Repository.exists(storage):
                return True
        except icechunk.IcechunkError:
            return False  # the storage itself fails: report the creation error
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _open(
    backend: StoreBackend, storage: icechunk.Storage, config: icechunk.RepositoryConfig, what: str
) -> icechunk.Repository:
    import icechunk

    try:
        repo = icechunk.Repository.open(storage, config=config)
        check_is_store(repo, backend)
    except icechunk.IcechunkError as e:
        raise translate(e, what) from None
    return repo


def check_is_store(repo: icechunk.Repository, backend: StoreBackend) -> None:
    """Refuse an Icechunk repository that is not a vcdask store.

    vcdask creates a store as a new, empty repository and commits only vcdask versions to its ``main``
    (every run writes its own branch): so ``main`` is at the repository's root snapshot (no parent) or at a
    vcdask version (its metadata has ``vcdask:format``).  Any other repository (a dataset's, whose ``main``
    holds its data) is not one: writing a version there would add to its tree, and a collection would
    delete its snapshots.

    Raises
    ------
    StoreNotFoundError
        ``main`` is at another snapshot (``missing`` is None: something is there, not nothing).
    """
    head = repo.lookup_snapshot(repo.lookup_branch("main"))
    if head.parent_id is None or is_version(head):
        return
    raise StoreNotFoundError(
        f"{backend.describe()} holds an Icechunk repository that is not a vcdask store: its branch 'main' is at "
        f"snapshot {head.id} ({head.message!r}), neither the repository's root nor a vcdask version. Give "
        "vcdask a new or empty location, or an existing vcdask store (a dataset repository can be a run's "
        "data: vcdask.fit(model, repo.readonly_session('main'), ...))"
    )


def _exists_error(backend: StoreBackend) -> StoreExistsError:
    return StoreExistsError(f"{backend.describe()} already holds a store and mode='w-' refuses to reuse it")
