"""What the data's finite check costs before a run: ``vcdask.finite.check_finite`` against one read of the data.

usage: python benchmarks/finite_checks.py [--sizes 10,100] [--repeat 3]

For each size (millions of float32 values, as X of shape (n, 100)): the check of a numpy array (in blocks of
``BLOCK_BYTES``), of a dask array (chunks of 64 MiB), and of the same data stored as a local Zarr dataset
(read through dask over its stored chunks); the floor beside each is one pass over the same data that any
check must make (numpy: ``X.sum()``; dask: ``X.sum().compute()``; Zarr: reading it into memory).  Prints a
markdown table of medians over ``--repeat`` runs.  The Zarr copies are written to a scratch directory that
is removed at the end.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import number_list


def _read_zarr(path: Path) -> np.ndarray:
    import xarray as xr

    return xr.open_zarr(path, consolidated=False)["x"].values


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import dask.array as da
    import xarray as xr

    from vcdask.data import prepare_data
    from vcdask.finite import check_finite

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10,100", help="millions of float32 values, a comma list (%(default)s)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = number_list(ap, "--sizes", args.sizes, int, minimum=1)
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="vcdask-bench-finite-") as tmp:
        for millions in sizes:
            n = millions * 10_000
            X = np.random.default_rng(0).random((n, 100), dtype=np.float32)
            y = np.zeros(n, dtype=np.int64)
            lazy = da.from_array(X, chunks=(2**26 // 400, 100))
            path = Path(tmp) / f"x{millions}.zarr"
            ds = xr.Dataset({"x": (("sample", "f"), X), "label": (("sample",), y)})
            ds.to_zarr(path, encoding={"x": {"chunks": (2**26 // 400, 100)}}, consolidated=False)
            cases = {
                "numpy": ((X, y), X.sum),
                "dask": ((lazy, da.from_array(y)), lazy.sum().compute),
                "Zarr (local)": (str(path), functools.partial(_read_zarr, path)),
            }
            for kind, (data, floor) in cases.items():
                prepared = prepare_data(data, label="label" if kind.startswith("Zarr") else None)
                check = timed(lambda prepared=prepared: check_finite(prepared), args.repeat)
                base = timed(floor, args.repeat)
                rows.append((millions, kind, X.nbytes / 2**20, check, base))
    print("| values (M) | data | MiB | check s | one pass s (floor) | check / floor |")
    print("|---|---|---|---|---|---|")
    for millions, kind, mib, check, base in rows:
        print(f"| {millions} | {kind} | {mib:.0f} | {check:.3f} | {base:.3f} | {check / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
