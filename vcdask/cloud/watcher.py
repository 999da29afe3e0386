"""A worker plugin that watches the provider's interruption notice and drains the worker in time."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from .. import config
from .._ints import is_real
from ..cluster import notify_runs
from .metadata import PROVIDERS, MetadataService, Notice, detect, provider_for

logger = logging.getLogger(__name__)

__all__ = ["PreemptionWatcher"]

#: Seconds a worker waits for the scheduler's answer to its notice, and for an acknowledgement.
ANSWER_TIMEOUT = 10.0
#: Seconds ``provider="auto"`` keeps looking for a metadata service (every ``interval``) before it gives up:
#: a service may be slow or down while the worker starts (Azure enables Scheduled Events on the first
#: call, which can take up to about two minutes to answer).
DETECT_FOR = 300.0


def _check_provider(provider: Any) -> str:
    if provider != "auto" and provider not in PROVIDERS:
        raise ValueError(f"unknown cloud provider {provider!r}; valid providers: {[*PROVIDERS, 'auto']}")
    return str(provider)


def _check_endpoint(endpoint: Any) -> str | None:
    if endpoint is None:
        return None
    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"endpoint must be an http:// or https:// URL (or None: the provider's own), got {endpoint!r}")
    return endpoint


def _check_interval(interval: Any) -> float:
    if not is_real(interval) or not 0 < interval < math.inf:
        raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
    return float(interval)


def _log_end(worker: Any, task: asyncio.Task) -> None:
    """Log the exception that ended the watch, if one did (no task awaits it: it would go unsaid)."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("%s: preemption watch ended: %r", worker.address, task.exception(), exc_info=task.exception())


class PreemptionWatcher(WorkerPlugin):
    """Poll the instance's metadata service for a spot/preemption notice; on one, drain and retire.

    On a notice the worker tells every vcdask run (:func:`vcdask.preempt` with the notice's window):
    no new shards go to it, its queued shards move elsewhere, a running shard keeps going if its
    expected remaining time fits the window with margin (else it is re-issued at once), and the
    worker then retires gracefully.  On a scheduler without vcdask runs it just retires.  Azure's
    event is acknowledged once the worker closes, so the instance may go at once.

    Parameters
    ----------
    provider : {"aws", "gcp", "azure", "auto"}, optional
        Whose protocol to speak; ``"auto"`` probes the metadata service and uses the one that
        answers.  A service slow or down at start is asked again every ``interval`` for
        :data:`DETECT_FOR` seconds (5 minutes); if none answers by then, the watcher logs a warning
        and stops.  Default: dask config
        ``vcdask.cloud.preemption.provider`` (``"auto"``).
    endpoint : str, optional
        ``http://host[:port]`` of the metadata service.  Default: dask config
        ``vcdask.cloud.preemption.endpoint``, else the provider's link-local address.
    interval : float, optional
        Seconds between polls.  Default: ``vcdask.cloud.preemption.interval`` (5, what AWS asks).
    timeout : float, default 2
        Seconds one request to the metadata service may take (``"auto"`` probes with at most 1 s, then
        polls the service it found with ``timeout``).

    A poll that fails (the service unreachable, an error status, an answer cut short or of an unexpected
    shape) is logged, once while it keeps failing, and the watcher polls again.  AWS and Azure say when
    the instance goes (an AWS window is at most its two minutes, whatever the worker's clock says); GCP
    does not, so its 30 s count from the last poll that saw no notice, the earliest it can have been
    posted.

    Settings left to the config are read on each worker, so a fleet can set them per machine
    (``DASK_VCDASK__CLOUD__PREEMPTION__ENDPOINT=...``).

    Examples
    --------
    >>> client.register_plugin(vcdask.cloud.PreemptionWatcher(provider="aws"))  # doctest: +SKIP
    """

    name = "vcdask-preemption-watcher"
    idempotent = True

    def __init__(
        self,
        provider: str | None = None,
        endpoint: str | None = None,
        interval: float | None = None,
        timeout: float = 2.0,
    ):
        self.provider = None if provider is None else _check_provider(provider)
        self.endpoint = _check_endpoint(endpoint)
        self.interval = None if interval is None else _check_interval(interval)
        self.timeout = _check_interval(timeout)
        self.notice: Notice | None = None
        self.service: MetadataService | None = None
        self._task: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"PreemptionWatcher(provider={self.provider!r}, endpoint={self.endpoint!r}, interval={self.interval!r})"

    def __getstate__(self) -> dict[str, Any]:
        # the settings travel; what one worker has seen and runs does not
        return {**self.__dict__, "notice": None, "service": None, "_task": None}

    # -- the plugin -------------------------------------------------------------------------------
    def setup(self, worker: Any) -> None:
        self.provider = _check_provider(config.get("cloud.preemption.provider", self.provider))
        self.endpoint = _check_endpoint(config.get("cloud.preemption.endpoint", self.endpoint))
        self.interval = _check_interval(config.get("cloud.preemption.interval", self.interval))
        self._task = asyncio.ensure_future(self._watch(worker))
        self._task.add_done_callback(lambda task: _log_end(worker, task))

    async def teardown(self, worker: Any) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.notice is not None and self.service is not None:  # Azure: the instance may go now
            loop = asyncio.get_running_loop()
            try:
                await asyncio.wait_for(
                    loop.run_in_executor(None, self.service.acknowledge, self.notice), ANSWER_TIMEOUT
                )
            except (OSError, TimeoutError) as e:
                logger.warning("%s: could not acknowledge the %s notice: %s", worker.address, self.service.name, e)

    # -- watching ---------------------------------------------------------------------------------
    def _service(self) -> MetadataService | None:
        if self.provider == "auto":  # (a short probe each: off the clouds nothing answers)
            found = detect(self.endpoint, min(self.timeout, 1.0))
            return None if found is None else provider_for(found.name, self.endpoint, self.timeout)
        return provider_for(str(self.provider), self.endpoint, self.timeout)

    async def _find(self, worker: Any) -> MetadataService | None:
        """The service to poll; in ``auto`` mode asked again every ``interval`` for :data:`DETECT_FOR` seconds
        (a service slow or down at start: Azure's first Scheduled Events call can take minutes)."""
        loop = asyncio.get_running_loop()
        give_up = time.monotonic() + DETECT_FOR
        while True:
            try:
                service = await loop.run_in_executor(None, self._service)
            except Exception as e:  # noqa: BLE001 - a detection that failed oddly is one that found nothing
                logger.debug("%s: preemption watch: detection failed: %r", worker.address, e)
                service = None
            if service is not None or time.monotonic() >= give_up:
                return service
            await asyncio.sleep(float(self.interval or 5))

    async def _watch(self, worker: Any) -> None:
        loop = asyncio.get_running_loop()
        self.service = service = await self._find(worker)
        if service is None:
            logger.warning(
                "%s: no cloud metadata service answered in %g s; not watching for preemption",
                worker.address,
                DETECT_FOR,
            )
            return
        logger.info("%s: watching %r for a preemption notice every %g s", worker.address, service, self.interval)
        failing = False
        clear_at: float | None = None  # (time.time()) the last answer that said no notice
        while True:
            try:
                notice = await loop.run_in_executor(None, service.poll)
            except Exception as e:  # unreachable, or an answer it could not read: ask again
                if not failing:  # (once while it fails: a service down for an hour logs one line, not 720)
                    odd = not isinstance(e, (OSError, ValueError))
                    logger.warning(
                        "%s: preemption watch: %s (retrying every %g s)", worker.address, e, self.interval, exc_info=odd
                    )
                failing = True
            else:
                failing = False
                if notice is not None:
                    await self._on_notice(worker, self._dated(notice, clear_at))
                    return
                clear_at = time.time()
            await asyncio.sleep(float(self.interval or 5))

    def _dated(self, notice: Notice, clear_at: float | None) -> Notice:
        """``notice`` with its window counted from the earliest it can have been posted, when the service does
        not say (GCP: 30 s from posting): right after the last poll that saw none (else one interval ago)."""
        if notice.dated:
            return notice
        since = notice.seen - clear_at if clear_at is not None else float(self.interval or 5)
        return replace(notice, seconds_left=max(0.0, notice.seconds_left - since), dated=True)

    async def _on_notice(self, worker: Any, notice: Notice) -> None:
        self.notice = notice
        window = max(0.0, notice.seconds_left - (time.time() - notice.seen))
        logger.warning("%s: %s; draining", worker.address, notice.describe())
        try:  # (on a scheduler without vcdask runs, this retires the worker: nothing else to tell)
            await notify_runs(
                worker.scheduler,
                worker.address,
                retire=True,
                window=window,
                reason=notice.describe(),
                timeout=ANSWER_TIMEOUT,
            )
        except Exception as e:  # noqa: BLE001 - the scheduler did not answer in time (or failed): just retire
            logger.info("%s: the scheduler did not take the notice (%r); retiring", worker.address, e)
            await worker.scheduler.retire_workers(workers=[worker.address], close_workers=True)
