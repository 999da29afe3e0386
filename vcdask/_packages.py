"""What the cluster's machines have of vcdask and PyTorch, asked before a run is staged or saved.

A worker without vcdask cannot unpickle the first shard task it is sent: its connection to the scheduler
fails and its ``dask worker`` process exits, and the run waits ``no_worker_timeout`` for workers that never
stay.  A scheduler without vcdask cannot take the plugin.  :func:`check_packages` asks the scheduler and
every connected worker with a function that needs nothing but the standard library to unpickle there (it
is sent by value: see :func:`_probe`), and refuses a cluster where any of them cannot import vcdask or
PyTorch, naming the machines.  A PyTorch or vcdask release that differs from this process's (major.minor
for PyTorch: a CPU build beside a CUDA one, ``2.4.1+cpu`` and ``2.4.0+cu121``, is the same) is a
warning: such clusters often work, and the warning says what to install where a run then fails to
unpickle its model.

The answers are remembered in this process, by machine: each later check (every ``fit`` and ``resume`` on the
same cluster) asks the scheduler once which workers it has and probes only the machines not seen before (a
scheduler or worker started again has another id: it is asked again).  Only answers that imported both
packages are remembered: a machine that lacked one, whose probe failed or that did not answer in time is
asked again the next time.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from ._stack import user_level
from .errors import ClusterPackageError

__all__ = [
    "KNOWN_MACHINES",
    "PACKAGES",
    "PROBE_SECONDS",
    "NoAnswer",
    "ask_workers",
    "check_packages",
    "check_scheduler_error",
    "probe",
    "roster",
]

#: The packages every machine of a run's cluster must import.
PACKAGES = ("vcdask", "torch")


def _probe() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The functions sent to the machines: ``probe`` imports each package of :data:`PACKAGES` (off the event
    loop: a fresh worker's first ``import torch`` takes seconds) and answers its version, or the import's error
    as ``"missing: <error>"``; ``roster``, run on the scheduler, answers its id, its workers (address -> the id
    of the worker's process) and, unless its id is ``known``, its own ``probe``.  Defined inside a function so
    that cloudpickle sends their code by value: a machine without vcdask could not unpickle a function pickled
    by reference to this module."""

    async def probe(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
        import asyncio
        import importlib

        def versions() -> dict[str, str]:
            found = {}
            for name in packages:
                try:
                    found[name] = str(getattr(importlib.import_module(name), "__version__", "unknown"))
                except Exception as e:  # noqa: BLE001 - what the import said is the answer
                    found[name] = f"missing: {type(e).__name__}: {e}"
            return found

        return await asyncio.get_running_loop().run_in_executor(None, versions)

    async def roster(dask_scheduler: Any = None, known: str | None = None) -> dict[str, Any]:
        workers = {
            address: str(getattr(ws, "server_id", None) or f"{ws.name}/{ws.pid}")
            for address, ws in dask_scheduler.workers.items()
        }
        seen: dict[str, Any] = {"id": str(dask_scheduler.id), "workers": workers}
        if seen["id"] != known:
            seen["versions"] = await probe()
        return seen

    return probe, roster


probe, roster = _probe()

#: How many machines' answers a process remembers (the oldest forgotten first).
KNOWN_MACHINES = 4096


class _Known:
    """The answers this process remembers, by machine (``"scheduler ADDRESS"``, ``"worker ADDRESS"``) with the
    id of the process that answered (another process at that address is another machine); only answers that
    imported every package of :data:`PACKAGES`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answers: OrderedDict[str, tuple[str, dict[str, str]]] = OrderedDict()

    def get(self, machine: str) -> tuple[str, dict[str, str]] | None:
        """The id of the process at ``machine`` whose answer is kept, and that answer (None: none kept)."""
        with self._lock:
            return self._answers.get(machine)

    def remember(self, machine: str, mid: str, found: Any) -> None:
        """Keep ``found`` as the answer of process ``mid`` at ``machine`` if it imported every package; else
        forget what was kept there (asked again next time)."""
        ok = isinstance(found, Mapping) and all(_said(found, name) is None for name in PACKAGES)
        with self._lock:
            if not ok:
                self._answers.pop(machine, None)
                return
            self._answers[machine] = (mid, dict(found))
            self._answers.move_to_end(machine)
            while len(self._answers) > KNOWN_MACHINES:
                self._answers.popitem(last=False)


_known = _Known()


def check_packages(client: Any) -> None:
    """Refuse a cluster whose scheduler or connected workers cannot import vcdask or PyTorch; warn where
    their releases differ from this process's.

    Parameters
    ----------
    client : distributed.Client

    Raises
    ------
    ClusterPackageError
        Some machines cannot import vcdask or torch: each named with what its import said, and what to do.

    Warns
    -----
    RuntimeWarning
        A machine runs another vcdask release, or another PyTorch major.minor, than this process.
    """
    import torch

    here = {"vcdask": sys.modules["vcdask"].__version__, "torch": torch.__version__}  # (importing vcdask: a cycle)
    address = client.scheduler.address
    known = _known.get(f"scheduler {address}")
    try:  # (one round trip: which workers there are, and the scheduler's own answer unless it is known)
        seen = client.run_on_scheduler(roster, known=known[0] if known else None)
    except Exception as e:  # (a scheduler that cannot even run the probe)
        raise ClusterPackageError(
            f"could not ask the scheduler at {address} which vcdask and torch it has "
            f"({type(e).__name__}: {e}); the scheduler needs both installed"
        ) from e
    if known is None or "versions" in seen:
        found_there = seen.get("versions")
        _known.remember(f"scheduler {address}", seen["id"], found_there)
    else:  # (the scheduler remembered, with the id it answered)
        found_there = known[1]
    answers: dict[str, Any] = {f"scheduler {address}": found_there}
    workers: dict[str, str] = seen["workers"]
    kept = {w: _kept_answer(_known.get(f"worker {w}"), wid) for w, wid in workers.items()}
    fresh = ask_workers(client, PROBE_SECONDS, workers=[w for w, found in kept.items() if found is None])
    for w, found in fresh.items():
        _known.remember(f"worker {w}", workers[w], found)
    answers.update({f"worker {w}": fresh[w] if found is None else found for w, found in kept.items()})
    check_answers(answers, here)


def _kept_answer(kept: tuple[str, dict[str, str]] | None, mid: str) -> dict[str, str] | None:
    """The answer kept for a machine, if the process that gave it is the one there now (id ``mid``)."""
    return kept[1] if kept is not None and kept[0] == mid else None


#: Seconds each worker has to answer the probe.  One that does not (frozen, swapping, leaving) is left
#: unknown, with a warning: the run's own deadlines deal with a stuck worker; the check must not hang on it.
PROBE_SECONDS = 10.0


class NoAnswer(Exception):
    """A worker did not answer the probe (no answer in time, or its connection failed): nothing is known."""


def ask_workers(
    client: Any, timeout: float, workers: list[str] | None = None, fn: Any = None, args: tuple = ()
) -> dict[str, Any]:
    """Each worker's answer to ``fn(*args)`` (default :data:`probe`; ``workers``: these addresses; default every
    connected worker), asked of all at once, each within ``timeout`` seconds: a worker that does not answer in
    time or whose connection fails gives a :class:`NoAnswer`, and one whose call raised gives that exception.
    (``client.run`` has no time limit: one frozen worker held it, and the run's start, for good.)"""
    call = probe if fn is None else fn
    import asyncio

    if workers is None:
        workers = list(client.scheduler_info()["workers"])
    if not workers:
        return {}

    async def one(worker: str) -> Any:
        try:
            answers = await asyncio.wait_for(client._run(call, *args, workers=[worker], on_error="return"), timeout)
        except TimeoutError:
            return NoAnswer(f"no answer within {timeout:g} s")
        except OSError as e:  # (its connection failed: it left, or its machine is gone)
            return NoAnswer(f"{type(e).__name__}: {e}")
        return answers.get(worker, NoAnswer("it left before answering"))

    async def every() -> dict[str, Any]:
        return dict(zip(workers, await asyncio.gather(*(one(w) for w in workers)), strict=True))

    return client.sync(every)


def check_answers(answers: Mapping[str, Any], here: Mapping[str, str]) -> None:
    """:func:`check_packages` on the machines' answers (machine -> package -> version, or the exception the
    probe raised there), against this process's versions ``here``."""
    missing: list[str] = []
    unknown: list[str] = []
    differ: dict[str, list[str]] = {}
    for machine, found in answers.items():
        if isinstance(found, NoAnswer):
            unknown.append(f"{machine} ({found})")
            continue
        if isinstance(found, BaseException) or not isinstance(found, Mapping):
            missing.append(f"{machine} (the probe failed: {type(found).__name__}: {found})")
            continue
        lacks = [f"{name} ({_said(found, name)})" for name in PACKAGES if _said(found, name) is not None]
        if lacks:
            missing.append(f"{machine} cannot import {', '.join(lacks)}")
            continue
        for name in PACKAGES:
            if _release(name, found[name]) != _release(name, here[name]):
                differ.setdefault(name, []).append(f"{machine}: {found[name]}")
    if missing:
        raise ClusterPackageError(
            f"{len(missing)} of the cluster's machines cannot run vcdask: " + "; ".join(missing) + ". Install "
            f"vcdask {here['vcdask']} and torch {here['torch']} (this process's) on the scheduler and every worker "
            "(in the environment their `dask scheduler` / `dask worker` runs in, or the image they start from), "
            "then start the run again; nothing was staged or saved"
        )
    if unknown:
        warnings.warn(
            f"could not ask {len(unknown)} of the cluster's workers which vcdask and torch they have: "
            f"{'; '.join(unknown)}. The run goes on; a worker that cannot import vcdask leaves on its first task",
            RuntimeWarning,
            stacklevel=user_level(),
        )
    for name, rows in differ.items():
        warnings.warn(
            f"{name} on the cluster differs from this process's {name} {here[name]}: {'; '.join(rows)}. A run may "
            f"fail to unpickle its model or spec there; if it does, install {name} {here[name]} on those machines",
            RuntimeWarning,
            stacklevel=user_level(),
        )


def _said(found: Mapping[str, Any], name: str) -> str | None:
    """What a machine's import of ``name`` said when it failed (None: it imported)."""
    answer = str(found.get(name, "missing: not answered"))
    return answer.removeprefix("missing: ") if answer.startswith("missing: ") else None


def _release(name: str, version: str) -> str:
    """What must match: PyTorch's major.minor (not its patch release or its ``+cpu`` / ``+cu121`` build),
    vcdask's whole version."""
    if name == "torch":
        return ".".join(version.split("+")[0].split(".")[:2])
    return version


def check_scheduler_error(client: Any, error: BaseException) -> None:
    """Raise :class:`ClusterPackageError` naming the scheduler when ``error`` (from asking it about, or
    registering, the plugin) is an import error there; else return (the caller raises ``error``)."""
    if isinstance(error, ImportError) and not isinstance(error, ClusterPackageError):
        raise ClusterPackageError(
            f"the scheduler at {client.scheduler.address} cannot import vcdask ({type(error).__name__}: {error}): "
            "install vcdask (and torch) in the environment its `dask scheduler` runs in, then start the run again"
        ) from error
