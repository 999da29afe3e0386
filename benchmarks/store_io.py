"""Commit and read latency of a 5M-parameter float32 state in the versioned parameter store.

usage: python benchmarks/store_io.py [--params 5000000] [--repeat 15] [--chunk-mib 1 4 16]

Prints one table: p50/p95 commit and read latency for a local directory and for the
loopback S3 server (moto), for several chunk sizes, beside the floors measured in the
same run: an in-memory copy of the same bytes, one raw file write/read, and one raw
S3 PUT/GET of the same bytes as a single object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from vcdask import open_store
from vcdask.params import flatten
from vcdask.testing.s3 import moto_server


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def bench_store(store, flat, repeat: int) -> tuple[list[float], list[float]]:
    store.commit(flat)  # warm-up: creates the arrays
    commits = timed(lambda: store.commit(flat), repeat)
    head = store.head()
    reads = timed(lambda: store.read(head), repeat)
    assert store.read(head).params.equal(flat)
    return commits, reads


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=5_000_000)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=[1, 4, 16])
    args = ap.parse_args(argv)
    if args.params < 1 or args.repeat < 1:
        ap.error(f"--params and --repeat must be >= 1, got {args.params} and {args.repeat}")
    if not all(c > 0 for c in args.chunk_mib):
        ap.error(f"--chunk-mib takes sizes > 0, got {args.chunk_mib}")
    torch.manual_seed(0)
    flat = flatten({"w": torch.randn(args.params)})
    mb = flat.nbytes / 1e6
    rows = []
    floor = timed(lambda: flat.arrays["float32"].clone(), args.repeat)
    rows.append(("in-memory copy (floor)", "-", floor, floor))
    data = flat.arrays["float32"].numpy()
    with tempfile.TemporaryDirectory() as d:  # one raw file: what the disk itself costs
        path = os.path.join(d, "raw.bin")
        rows.append(
            (
                "raw file write / read (floor)",
                "-",
                timed(lambda: data.tofile(path), args.repeat),
                timed(lambda: np.fromfile(path, dtype=np.float32), args.repeat),
            )
        )
    with moto_server() as s3:
        bucket, client, payload = s3.new_bucket(), s3.client(), data.tobytes()
        rows.append(
            (
                "raw S3 put / get of one object (floor)",
                "-",
                timed(lambda: client.put_object(Bucket=bucket, Key="raw", Body=payload), args.repeat),
                timed(lambda: client.get_object(Bucket=bucket, Key="raw")["Body"].read(), args.repeat),
            )
        )
        for chunk_mib in args.chunk_mib:
            cb = int(chunk_mib * 2**20)
            with tempfile.TemporaryDirectory() as d:
                rows.append(
                    ("local directory", chunk_mib, *bench_store(open_store(d, chunk_bytes=cb), flat, args.repeat))
                )
            bucket = s3.new_bucket()
            store = open_store(f"s3://{bucket}/bench", chunk_bytes=cb, **s3.options())
            rows.append(("local S3 server (moto)", chunk_mib, *bench_store(store, flat, args.repeat)))
    print(f"\n{args.params:,} float32 parameters ({mb:.0f} MB), {args.repeat} repeats, times in ms\n")
    print("| store | chunk MiB | commit p50 | commit p95 | read p50 | read p95 | commit / floor | read / floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    f50 = statistics.median(floor)
    for name, chunk, commits, reads in rows:
        c50, r50 = statistics.median(commits), statistics.median(reads)
        print(
            f"| {name} | {chunk} | {c50:.1f} | {pct(commits, 0.95):.1f} | {r50:.1f} | {pct(reads, 0.95):.1f} "
            f"| {c50 / f50:.0f}x | {r50 / f50:.0f}x |"
        )


if __name__ == "__main__":
    main()
