"""What a version's checksums cost: commits and reads with ``vcdask.store.checksums`` on and off.

usage: python benchmarks/checksums.py [--params 5000000,100000000] [--repeat 7] [--stores local,s3]

For each size (float32 parameters) and store (a local directory; the loopback S3 server, moto): commit
``--repeat`` versions on one branch (each from different values, the run's fast path: the branch head is
this store object's last commit), then read each version back, once with checksums recorded and
verified (the default) and once without, alternating so the disk's writeback hits both alike: ``first
read`` by a store object opened for it (its first read goes through Zarr, and the checksums are computed
after it, as ``vcdask.load`` reads), ``read`` by one store object that has read a version before (a run's
reads: the chunks are copied into place and hashed block by block, see ``_checksum.Hasher``).  Prints
the medians (ms) and the ratio on / off.  The checksum alone (``vcdask.store._checksum.checksums``) is
timed beside them: the floor of what it can add.  Stores are scratch directories and buckets, removed
at the end.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import dask
import torch
from _args import choices_list, number_list

from vcdask import open_store
from vcdask.params import flatten
from vcdask.store._checksum import checksums
from vcdask.testing.s3 import moto_server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="5000000,100000000", help="float32 parameters, a comma list")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--stores", default="local,s3", help="a comma list of local (a directory), s3 (moto on loopback)")
    args = ap.parse_args(argv)
    sizes = number_list(ap, "--params", args.params, int, minimum=1)
    kinds = choices_list(ap, "--stores", args.stores, ("local", "s3"))
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    rows = []
    with moto_server() as s3, tempfile.TemporaryDirectory(prefix="vcdask-bench-sums-") as tmp:
        for n in sizes:
            flats = [flatten({"w": torch.randn(n, generator=torch.Generator().manual_seed(i))}) for i in range(2)]
            alone = []
            for i in range(args.repeat):
                t0 = time.perf_counter()
                checksums(flats[i % 2])
                alone.append(time.perf_counter() - t0)
            for kind in kinds:
                times: dict[tuple[str, bool], list[float]] = {}
                stores = {}
                for on in (True, False):
                    where = f"{tmp}/{kind}-{n}-{on}" if kind == "local" else f"s3://{s3.new_bucket()}/b"
                    stores[on] = open_store(where, **({} if kind == "local" else s3.options()))
                versions: dict[bool, list[str]] = {True: [], False: []}
                for i in range(args.repeat):
                    for on in (True, False):
                        with dask.config.set({"vcdask.store.checksums": on}):
                            t0 = time.perf_counter()
                            versions[on].append(stores[on].commit(flats[i % 2], {"step": i}))
                            times.setdefault(("commit", on), []).append(time.perf_counter() - t0)
                kept = {
                    on: open_store(stores[on].location, **({} if kind == "local" else s3.options())) for on in stores
                }
                for on in (True, False):  # its first read learns the layout (through Zarr)
                    kept[on].read(versions[on][0])
                for i in range(args.repeat):
                    for on in (True, False):
                        reader = open_store(stores[on].location, **({} if kind == "local" else s3.options()))
                        with dask.config.set({"vcdask.store.checksums": on}):
                            t0 = time.perf_counter()
                            reader.read(versions[on][i])
                            times.setdefault(("first read", on), []).append(time.perf_counter() - t0)
                            t0 = time.perf_counter()
                            kept[on].read(versions[on][i])
                            times.setdefault(("read", on), []).append(time.perf_counter() - t0)
                for op in ("commit", "first read", "read"):
                    on, off = (statistics.median(times[(op, v)]) * 1e3 for v in (True, False))
                    rows.append((n, kind, op, on, off, statistics.median(alone) * 1e3))
    print("| parameters | store | operation | checksums on, ms | off, ms | on / off | checksum alone, ms |")
    print("|---|---|---|---|---|---|---|")
    for n, kind, op, on, off, alone_ms in rows:
        print(f"| {n:,} | {kind} | {op} | {on:.1f} | {off:.1f} | {on / off:.2f}x | {alone_ms:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
