"""What instance a worker that joins runs on, asked at once, for the runs that count their cost.

A worker says its instance type and market (its Dask config ``vcdask.cloud.instance``) with each shard it
starts.  A spot worker that joined and was reclaimed before its first shard never said it: its billed
time was left out of the run's cost, the worker listed ``unpriced``.  So the plugin asks each worker that
joins while a run counts its cost (the run has prices), as ``client.run`` would ask it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from ..cost import instance_here
from .core import messages as m

logger = logging.getLogger(__name__)

__all__ = ["ASK_TIMEOUT", "identify"]

#: Seconds a joining worker has to say its instance (else its first shard says it, as before).
ASK_TIMEOUT = 10.0


async def identify(scheduler: Any, worker: str, runs: Callable[[], Iterable[Any]]) -> None:
    """Ask ``worker`` its instance (:func:`vcdask.cost.instance_here`) and tell the live runs that count cost
    (``runs()``: their shells); a worker that does not answer in time is left to say it with its first shard."""
    from distributed.protocol import deserialize
    from distributed.protocol.pickle import dumps
    from distributed.protocol.serialize import Serialized

    msg = {"op": "run", "function": dumps(instance_here), "args": dumps(()), "kwargs": dumps({})}
    try:
        answers = await asyncio.wait_for(scheduler.broadcast(msg=msg, workers=[worker], on_error="return"), ASK_TIMEOUT)
    except (OSError, TimeoutError) as e:
        logger.debug("worker %s did not say its instance: %r", worker, e)
        return
    answer = answers.get(worker)
    said = answer.get("result") if isinstance(answer, dict) and answer.get("status") == "OK" else None
    if isinstance(said, Serialized):  # (the worker's answer comes as the client would read it)
        said = deserialize(said.header, said.frames)
    if not isinstance(said, dict):
        logger.debug("worker %s did not say its instance: %r", worker, answer)
        return
    for run in runs():
        if run.spec.prices and not run.done.is_set():
            run.step_now(m.Identified(worker, said.get("instance"), said.get("market")))
