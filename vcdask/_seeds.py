"""The seeds a run derives from its ``seed=``, and torch's global generator seeded for a task.

Each task's batch order and its dropout (any draw from torch's global generator: the model's, a ``train_step``'s,
a Dataset's augmentations) come from ``(seed, epoch, shard, attempt)``, through numpy's
:class:`~numpy.random.SeedSequence`: any seed ``>= 0`` (``time.time_ns()`` too) gives 63-bit seeds torch takes,
and no two tasks of a run share one.  A task seeds torch's global generator inside :func:`task_rng` and puts it
back after: one worker and one seed train alike again, and the process that called ``fit`` (threads of an
in-process cluster, the scheduler's probe) keeps its own stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["derived_seeds", "task_rng"]

_MASK = (1 << 63) - 1


def derived_seeds(seed: int, *parts: int, n: int = 2) -> tuple[int, ...]:
    """``n`` seeds in ``[0, 2**63)`` from ``seed`` and ``parts`` (non-negative ints), independent of each other
    and of every other ``(seed, *parts)``."""
    import numpy as np

    words = np.random.SeedSequence([int(seed), *map(int, parts)]).generate_state(n, np.uint64)
    return tuple(int(w) & _MASK for w in words)


@contextlib.contextmanager
def task_rng(seed: int, device: Any = None) -> Iterator[None]:
    """torch's generators a task draws from seeded with ``seed`` inside the block, as they were after it: the CPU's,
    and ``device``'s own when it is a CUDA device (that one device's: ``torch.manual_seed`` would reseed every GPU
    of the process, and put back only one) or MPS.  Tasks of one process share these generators: with several
    threads a worker's tasks interleave their draws, and their putting back."""
    import torch

    kind = getattr(device, "type", None)
    cpu = torch.get_rng_state()
    if kind == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        own = torch.cuda.get_rng_state(index)
    elif kind == "mps":
        own = torch.mps.get_rng_state()
    torch.default_generator.manual_seed(seed)
    if kind == "cuda":
        with torch.cuda.device(index):
            torch.cuda.manual_seed(seed)
    elif kind == "mps":
        torch.mps.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if kind == "cuda":
            torch.cuda.set_rng_state(own, index)
        elif kind == "mps":
            torch.mps.set_rng_state(own)
