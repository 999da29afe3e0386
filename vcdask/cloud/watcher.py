"""A worker plugin that watches the provider's interruption notice and drains the worker in time."""

from __future__ import annotations

import asyncio
import logging
import math
import time
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
        answers (none: the watcher logs it and stops).  Default: dask config
        ``vcdask.cloud.preemption.provider`` (``"auto"``).
    endpoint : str, optional
        ``http://host[:port]`` of the metadata service.  Default: dask config
        ``vcdask.cloud.preemption.endpoint``, else the provider's link-local address.
    interval : float, optional
        Seconds between polls.  Default: ``vcdask.cloud.preemption.interval`` (5, what AWS asks).
    timeout : float, default 2
        Seconds one request to the metadata service may take.

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
        if self.provider == "auto":
            return detect(self.endpoint, min(self.timeout, 1.0))
        return provider_for(str(self.provider), self.endpoint, self.timeout)

    async def _watch(self, worker: Any) -> None:
        loop = asyncio.get_running_loop()
        self.service = service = await loop.run_in_executor(None, self._service)
        if service is None:
            logger.info("%s: no cloud metadata service answered; not watching for preemption", worker.address)
            return
        logger.info("%s: watching %r for a preemption notice every %g s", worker.address, service, self.interval)
        failing = False
        while True:
            try:
                notice = await loop.run_in_executor(None, service.poll)
            except (OSError, ValueError, KeyError) as e:  # unreachable, or an answer it could not read
                if not failing:
                    logger.warning("%s: preemption watch: %s (retrying every %g s)", worker.address, e, self.interval)
                failing = True
            else:
                failing = False
                if notice is not None:
                    await self._on_notice(worker, notice)
                    return
            await asyncio.sleep(float(self.interval or 5))

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
