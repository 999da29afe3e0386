"""What reading and collecting a store costs as runs pile up in it (one store, many runs, local directory).

usage: python benchmarks/many_runs.py [--runs 10,50,150] [--repeat 3] [--store DIR]

Every ``vcdask.fit`` writes its own branch (its run id) and leaves, after its final collection, a pin
(``vcdask.keep.<version>.<run>``) for each version its retention keeps: a tiny run of two epochs keeps all five
of its versions, so six Icechunk branches per run.  This builds such runs one after another in one store, as
the engine writes them (five versions with their ``step``/``epoch`` metadata and the writer's ``keep_from``
marker, a pin per version, a run spec and an ended run's record), without training (a real fit costs seconds
each; the store holds the same refs and snapshots), and at each size in ``--runs`` times (median of
``--repeat``, ten times that for ``versions``; in ms):

- ``store.gc()``: a collection of every branch (``vcdask gc STORE``), which removes nothing here;
- ``store.versions(run)`` of the newest run;
- ``vcdask runs STORE``, the listing of every run;
- a run's own collection, ``store.gc(branches=[run], in_use={run: step})``, what the engine does every
  ``Retention.interval`` seconds during a run and once at its end.

Each should cost what the branches it reads need, not more for every other run in the store.  The store is a
temporary directory removed at the end (``--store``: a new directory kept there).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _args import number_list  # noqa: E402
from _scratch import scratch_store  # noqa: E402

#: A run's versions: (step, epoch), as a two-epoch run of two shards writes them.
VERSIONS = ((0, 0), (1, 1), (2, 1), (3, 2), (4, 2))


def add_runs(store, first: int, count: int) -> str:
    """``count`` ended runs more in ``store`` (numbered from ``first``); the newest run's id."""
    import torch

    from vcdask.store._history import pin_name

    run = ""
    for i in range(first, first + count):
        run = f"run-20260101-{i // 3600:02d}{i // 60 % 60:02d}{i % 60:02d}-{i:06x}"
        store.create_branch(run)
        for step, epoch in VERSIONS:
            meta = {"run_id": run, "step": step, "epoch": epoch}
            version = store.commit({"w": torch.full((8,), float(step))}, meta, branch=run, keep_from=step)
            store._repo.create_branch(pin_name(version, run), version)  # what the run's final collection pins
        store.files.put(f"{run}/spec.pkl", b"")  # (`vcdask runs` looks for it; it never unpickles it)
        now = time.time()
        record = {"status": "finished", "stop_kind": "max_epochs", "epochs_done": 2, "max_epochs": 2}
        store.files.put(f"{run}/status.json", json.dumps({**record, "started": now, "ended": now}).encode())
    return run


def timed(fn, repeat: int) -> float:
    """Median milliseconds of ``repeat`` calls of ``fn``."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def listing(location: str) -> None:
    """``vcdask runs STORE``, its output dropped."""
    from vcdask.cli import main as cli

    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["runs", location]) == 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="10,50,150", help="store sizes to measure at, in runs (comma list)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--store", default=None, help="build the store in this new directory and keep it")
    args = ap.parse_args(argv)
    sizes = sorted(set(number_list(ap, "--runs", args.runs, int, minimum=1)))
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.store is not None and os.path.exists(args.store):
        ap.error(f"--store: {args.store!r} exists; name a new directory")

    import vcdask
    from vcdask import Retention

    rows = []
    with scratch_store(args.store, "many-runs") as location:
        store = vcdask.open_store(location)
        built, run = 0, ""
        for n in sizes:
            run = add_runs(store, built, n - built)
            built = n
            rows.append(
                (
                    n,
                    len(store._repo.list_branches()),
                    timed(lambda: store.gc(), args.repeat),
                    timed(lambda r=run: store.versions(r), 10 * args.repeat),
                    timed(lambda: listing(location), args.repeat),
                    timed(lambda r=run: store.gc(Retention(), branches=[r], in_use={r: VERSIONS[-1][0]}), args.repeat),
                )
            )
            print(f"{n} runs measured", file=sys.stderr)
    print(f"\nlocal directory store, median of {args.repeat}, times in ms\n")
    print("| runs | Icechunk branches | store.gc() | store.versions(run) | vcdask runs | a run's own collection |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, branches, gc_ms, versions_ms, runs_ms, own_ms in rows:
        print(f"| {n} | {branches} | {gc_ms:.0f} | {versions_ms:.1f} | {runs_ms:.0f} | {own_ms:.0f} |")


if __name__ == "__main__":
    main()
