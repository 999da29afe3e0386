"""What a worker that joins a live run is, asked at once: its instance (for the runs that count their cost) and
its vcdask (for every run).

A worker says its instance type and market (its Dask config ``vcdask.cloud.instance``) with each shard it
starts.  A spot worker that joined and was reclaimed before its first shard never said it: its billed
time was left out of the run's cost, the worker listed ``unpriced``.  So the plugin asks each worker that
joins while a run goes, as ``client.run`` would ask it.

It asks its vcdask and torch versions too.  The launch checks the workers there then (:mod:`vcdask._packages`);
one that joined later with another vcdask trained shards without a word, and where its tasks and the
scheduler's plugin no longer spoke alike its shards were lost and trained again.  A worker whose vcdask is not
the scheduler's (the whole version, as the launch compares it) is unfit for the live runs: named, it gets no
shards.  Another torch release is only logged, as the launch only warns of it.
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
    """What the asked worker says: its instance and market (:func:`vcdask.cost.instance_here`), its vcdask's and
    torch's versions.  Sent by value: a worker with another vcdask (one without this module) answers too."""
    import importlib

    import torch

    try:
        facts: dict[str, Any] = dict(importlib.import_module("vcdask.cost").instance_here())
    except Exception:  # noqa: BLE001 - another vcdask: its versions still say what matters
        facts = {}
    version = getattr(importlib.import_module("vcdask"), "__version__", "unknown")
    return {**facts, "vcdask": str(version), "torch": str(torch.__version__)}


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
    unfit = _mismatch(worker, said)
    for run in runs():
        if not run.done.is_set() and (run.spec.prices or unfit is not None):
            run.step_now(m.Identified(worker, said.get("instance"), said.get("market"), unfit))


def _mismatch(worker: str, said: dict[str, Any]) -> str | None:
    """Why ``worker`` cannot run this scheduler's runs (its vcdask is another), or None; another torch release
    is logged."""
    import sys

    import torch

    from .._packages import _release

    ours = {"vcdask": str(sys.modules["vcdask"].__version__), "torch": str(torch.__version__)}  # (imported: a cycle)
    theirs = {name: str(said.get(name)) for name in ours}
    if _release("torch", theirs["torch"]) != _release("torch", ours["torch"]):
        logger.warning(
            "worker %s joined with torch %s, the scheduler has %s: a run may fail to unpickle its model there",
            worker,
            theirs["torch"],
            ours["torch"],
        )
    if theirs["vcdask"] == ours["vcdask"]:
        return None
    return (
        f"worker {worker} joined with vcdask {theirs['vcdask']}, not the scheduler's {ours['vcdask']}: its tasks and "
        f"the run would not speak alike; install vcdask {ours['vcdask']} there (and on every machine of the cluster)"
    )


def _by_value(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as cloudpickle sends a function of ``__main__``: its code, not its module's name (a worker with
    another vcdask may not have this module)."""
    import types

    return types.FunctionType(fn.__code__, {"__builtins__": __builtins__}, fn.__name__)
