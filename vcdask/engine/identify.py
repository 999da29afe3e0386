"""What a worker that joins a live run is, asked at once: its instance (for the runs that count their cost) and
its vcdask (for every run).

A worker says its instance type and market (its Dask config ``vcdask.cloud.instance``) with each shard it
starts.  A spot worker that joined and was reclaimed before its first shard never said it: its billed
time was left out of the run's cost, the worker listed ``unpriced``.  So the plugin asks each worker that
joins while a run goes, as ``client.run`` would ask it.

It asks its vcdask and torch versions too.  The launch checks the workers there then (:mod:`vcdask._packages`)
and warns of another vcdask (the whole version) or torch (major.minor); one that joined later trained shards
without a word, and where its tasks and the scheduler's plugin no longer spoke alike its shards were lost and
trained again.  It is now said as it joins, in the scheduler's log, naming the worker and what to install.  It
is not excluded: the launch lets such workers train once it has warned, and a fleet that scales up from no
worker would otherwise lose every worker of a build the launch accepted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from .core import messages as m

logger = logging.getLogger(__name__)

__all__ = ["ASK_TIMEOUT", "identify", "worker_facts"]

#: Seconds a joining worker has to answer (else its first shard says its instance, as before).
ASK_TIMEOUT = 10.0


def worker_facts() -> dict[str, Any]:
    """What the asked worker says: its instance and market (its Dask config ``vcdask.cloud.instance``, as
    :func:`vcdask.cost.instance_here` reads it), its vcdask's and torch's versions.  Sent by value (a worker with
    another vcdask, one without this module, answers too), and run on the worker's event loop: it imports nothing
    (a fresh worker's first ``import torch`` takes seconds); a package not imported there yet says its installed
    version."""
    import sys
    from importlib import metadata

    import dask.config

    def version(name: str) -> str:
        module = sys.modules.get(name)
        if module is not None:
            return str(getattr(module, "__version__", "unknown"))
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "missing"

    kind = dask.config.get("vcdask.cloud.instance.type", None)
    market = dask.config.get("vcdask.cloud.instance.market", None) or "on-demand"
    return {
        "instance": None if kind is None else str(kind),
        "market": str(market),
        "vcdask": version("vcdask"),
        "torch": version("torch"),
    }


async def identify(scheduler: Any, worker: str, runs: Callable[[], Iterable[Any]]) -> None:
    """Ask ``worker`` what it is (:func:`worker_facts`) and tell the live runs (``runs()``: their shells); a worker
    that does not answer in time is left to say its instance with its first shard."""
    import cloudpickle
    from distributed.protocol import deserialize
    from distributed.protocol.pickle import dumps
    from distributed.protocol.serialize import Serialized

    ask = cloudpickle.dumps(_by_value(worker_facts))
    msg = {"op": "run", "function": ask, "args": dumps(()), "kwargs": dumps({})}
    try:
        answers = await asyncio.wait_for(scheduler.broadcast(msg=msg, workers=[worker], on_error="return"), ASK_TIMEOUT)
    except (OSError, TimeoutError) as e:
        logger.debug("worker %s did not say what it is: %r", worker, e)
        return
    answer = answers.get(worker)
    said = answer.get("result") if isinstance(answer, dict) and answer.get("status") == "OK" else None
    if isinstance(said, Serialized):  # (the worker's answer comes as the client would read it)
        said = deserialize(said.header, said.frames)
    if not isinstance(said, dict):
        logger.debug("worker %s did not say what it is: %r", worker, answer)
        return
    _say_mismatch(worker, said)
    for run in runs():
        if run.spec.prices and not run.done.is_set():
            run.step_now(m.Identified(worker, said.get("instance"), said.get("market")))


def _say_mismatch(worker: str, said: dict[str, Any]) -> None:
    """Log that ``worker`` has another vcdask or torch than the scheduler, as the launch's check compares them."""
    import sys

    import torch

    from .._packages import _release

    ours = {"vcdask": str(sys.modules["vcdask"].__version__), "torch": str(torch.__version__)}  # (imported: a cycle)
    for name, mine in ours.items():
        theirs = str(said.get(name))
        if _release(name, theirs) != _release(name, mine):
            logger.warning(
                "worker %s joined with %s %s, the scheduler has %s: the run's tasks may fail there (to unpickle its "
                "model or spec, or to speak with the scheduler: lost and trained again); install %s %s on it",
                worker,
                name,
                theirs,
                mine,
                name,
                mine,
            )


def _by_value(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as cloudpickle sends a function of ``__main__``: its code, not its module's name (a worker with
    another vcdask may not have this module)."""
    import types

    return types.FunctionType(fn.__code__, {"__builtins__": __builtins__}, fn.__name__)
