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
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ClusterPackageError

__all__ = ["PACKAGES", "PROBE_SECONDS", "NoAnswer", "ask_workers", "check_packages", "check_scheduler_error", "probe"]

#: The packages every machine of a run's cluster must import.
PACKAGES = ("vcdask", "torch")


def _probe() -> Callable[[], Any]:
    """The function sent to the machines: it imports each package of :data:`PACKAGES` (off the event loop:
    a fresh worker's first ``import torch`` takes seconds) and answers its version, or the import's error as
    ``"missing: <error>"``.  Defined inside a function so that cloudpickle sends its code by value: a machine
    without vcdask could not unpickle a function pickled by reference to this module."""

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

    return probe


probe = _probe()


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
    try:
        scheduler = client.run_on_scheduler(probe)
    except Exception as e:  # (a scheduler that cannot even run the probe)
        raise ClusterPackageError(
            f"could not ask the scheduler at {client.scheduler.address} which vcdask and torch it has "
            f"({type(e).__name__}: {e}); the scheduler needs both installed"
        ) from e
    answers = {f"scheduler {client.scheduler.address}": scheduler}
    answers.update({f"worker {w}": found for w, found in ask_workers(client, PROBE_SECONDS).items()})
    check_answers(answers, here)


#: Seconds each worker has to answer the probe.  One that does not (frozen, swapping, leaving) is left
#: unknown, with a warning: the run's own deadlines deal with a stuck worker; the check must not hang on it.
PROBE_SECONDS = 10.0


class NoAnswer(Exception):
    """A worker did not answer the probe (no answer in time, or its connection failed): nothing is known."""


def ask_workers(client: Any, timeout: float) -> dict[str, Any]:
    """Each connected worker's answer to :data:`probe`, asked of all at once, each within ``timeout`` seconds:
    a worker that does not answer in time or whose connection fails gives a :class:`NoAnswer`, and one whose
    probe raised gives that exception.  (``client.run`` has no time limit: one frozen worker held it, and the
    run's start, for good.)"""
    import asyncio

    workers = list(client.scheduler_info()["workers"])

    async def one(worker: str) -> Any:
        try:
            answers = await asyncio.wait_for(client._run(probe, workers=[worker], on_error="return"), timeout)
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
            stacklevel=3,
        )
    for name, rows in differ.items():
        warnings.warn(
            f"{name} on the cluster differs from this process's {name} {here[name]}: {'; '.join(rows)}. A run may "
            f"fail to unpickle its model or spec there; if it does, install {name} {here[name]} on those machines",
            RuntimeWarning,
            stacklevel=3,
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
