"""How much a virtual machine's never-touched memory costs, and warming it before the other benchmarks.

usage: python benchmarks/warm_memory.py [--gib 16] [--check]

On this project's 2-core VM a page of guest memory costs far more the first time the guest touches it
(the hypervisor backs it then) than ever after.  Every benchmark that moves tens of megabytes per
step into fresh memory (new files in the page cache, new arrays) pays that cost until enough of the
machine's memory has been touched once since boot: measured at stop 31, a 20 MB file write took
42 ms into never-touched memory and 4 ms after, and ``merge_bound.py`` went from 9 to 17-19 merges/s
(vc-asgd) with nothing else changed.  Run this once after the machine starts, before measuring.

It touches ``--gib`` GiB of anonymous memory twice (the first pass pays the first touch; the second
is the floor) and prints both rates, then writes and removes 40 files of 20 MB beside the temporary
directory the benchmarks use, timing the median write.  ``--check``: only the file writes (no warming),
to see whether the machine is warm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def touch(gib: float) -> float:
    """Seconds to allocate and write ``gib`` GiB (then free it)."""
    t = time.perf_counter()
    block = np.ones(int(gib * 2**30) // 8)
    seconds = time.perf_counter() - t
    del block
    return seconds


def file_writes(n: int = 40, mb: int = 20) -> float:
    """Median seconds to write one new ``mb`` MB file into the temporary directory (files kept until
    all are written, so each write takes fresh page-cache pages)."""
    data = np.random.default_rng(0).random(mb * 2**20 // 8).tobytes()
    times = []
    with tempfile.TemporaryDirectory(prefix="vcdask-bench-warm-") as d:
        for i in range(n):
            t = time.perf_counter()
            with open(os.path.join(d, f"{i}.bin"), "wb") as f:
                f.write(data)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16.0, help="memory to touch (leave the OS a few GiB)")
    ap.add_argument("--check", action="store_true", help="only time the file writes")
    args = ap.parse_args(argv)
    rows = [("20 MB file write, median (before)", f"{1000 * file_writes():.1f} ms")]
    if not args.check:
        first, second = touch(args.gib), touch(args.gib)
        rows += [
            (f"touch {args.gib:g} GiB, first pass", f"{args.gib * 1024 / first:.0f} MiB/s"),
            (f"touch {args.gib:g} GiB, second pass", f"{args.gib * 1024 / second:.0f} MiB/s"),
            ("20 MB file write, median (after)", f"{1000 * file_writes():.1f} ms"),
        ]
    print("| what | measured |\n|---|---|")
    for what, value in rows:
        print(f"| {what} | {value} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
