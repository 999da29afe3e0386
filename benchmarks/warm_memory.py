"""What fresh memory costs on this machine: the first touch of a page against every later one.

usage: python benchmarks/warm_memory.py [--gib 12] [--wait 30]

On this project's 2-core virtual machine a page of guest memory the host has not backed (never touched
since boot, or freed and handed back to the host) costs far more to touch than one already backed.  Every
write of a new file into the page cache takes fresh pages, so a local store's commit of a 20 MB version
costs what 20 MB of fresh memory costs, whatever the store does.

Prints: a new 20 MB file's write (median of 40, kept until all are written); touching ``--gib`` GiB of
anonymous memory twice (the first pass pays for fresh pages, the second is the floor); the file write
again right after, and once more ``--wait`` seconds later (measured at stop 31: 28-50 ms, 476 MiB/s first
touch against 9018 MiB/s, 4.5 ms right after, 50 ms 30 s later in one run and 5.8 ms 20 s later in
another: the host takes freed memory back within tens of seconds, so memory "warmed" before a benchmark
does not stay warm).
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
    with tempfile.TemporaryDirectory(prefix="vcdask-bench-memory-") as d:
        for i in range(n):
            t = time.perf_counter()
            with open(os.path.join(d, f"{i}.bin"), "wb") as f:
                f.write(data)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=12.0, help="memory to touch (leave the OS a few GiB)")
    ap.add_argument("--wait", type=float, default=30.0, help="seconds before the last file write")
    args = ap.parse_args(argv)
    total_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if not 0 < args.gib < total_gib:
        ap.error(f"--gib must be > 0 and below this machine's {total_gib:.1f} GiB of memory, got {args.gib:g}")
    if args.wait < 0:
        ap.error(f"--wait must be >= 0, got {args.wait:g}")
    rows = [("new 20 MB file, write (median)", f"{1000 * file_writes():.1f} ms")]
    first, second = touch(args.gib), touch(args.gib)
    rows += [
        (f"touch {args.gib:g} GiB, first pass", f"{args.gib * 1024 / first:.0f} MiB/s"),
        (f"touch {args.gib:g} GiB, second pass", f"{args.gib * 1024 / second:.0f} MiB/s"),
        ("new 20 MB file, write, right after", f"{1000 * file_writes():.1f} ms"),
    ]
    time.sleep(args.wait)
    rows.append((f"new 20 MB file, write, {args.wait:g} s later", f"{1000 * file_writes():.1f} ms"))
    print("| what | measured |\n|---|---|")
    for what, value in rows:
        print(f"| {what} | {value} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
