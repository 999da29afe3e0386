"""When the merges set the pace: staleness and accuracy of runs whose merge thread is the bottleneck.

usage: python benchmarks/merge_queue.py [--busy 0,2] [--cases nesterov,probe,screened]
                                        [--wait progress,bounded] [--seeds 0,1,2] [--max-epochs 8]

Every run is ``vcdask.fit`` of the demo CNN on the demo's digits (``vcdask.demo.digits(seed)``, 10% held out
for validation), 8 shards, ``--max-epochs`` epochs, on a ``LocalCluster`` of 4 spawned worker processes with
one thread each, started once and reused; each run's store is a scratch directory removed after it.

Cases (``--cases``), each a merge path of a different cost:

* ``nesterov``: delayed Nesterov (lr 0.5, momentum 0.9), a merge of a few vector operations;
* ``probe``:    the probe rule (``merge="probe"``): 7-9 forward passes over 64 rows in the merge thread;
* ``screened``: the probe rule under ``Resilience(max_norm_ratio=3.0, min_cosine=0.0)``, whose screen takes
  the server's own local steps for every update, with one sign-flipping worker of the four (its updates are
  rejected; accuracy and staleness are the honest run's).

``--busy N``: N busy-loop processes run beside each run (a machine shared with other work, or a scheduler
slower than its workers): on these 2 cores the merge thread then falls behind the workers.

``--wait``: how long a task waits for the merges of the results that came back before it asked for its
base (``vcdask.engine.handshake.Handshake.settled_through``). ``progress`` is vcdask's: as long as the merge
path goes on, at most :func:`vcdask.engine.policy.base_wait` (one median shard time) for each of its steps
and ``BASE_WAIT_STEPS`` (2) times that in all.
``bounded`` is the rule before stop 56, patched into the scheduler (it runs in this process): at most one
median shard time for the whole wait, after which the task trains from the version there is.

Per (busy, wait, case), medians over the seeds: test accuracy, the median and largest staleness of the
merged updates, updates turned down as too stale, and the run's wall time.  The unloaded rows are the
floor the loaded ones are held against.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # inherited by the spawned workers: they unpickle robust.HostileAdam by reference

from _scratch import scratch_store  # noqa: E402

CASES = ("nesterov", "probe", "screened")
WAITS = ("progress", "bounded")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _spin() -> None:  # pragma: no cover - a busy loop, killed by the benchmark
    while True:
        pass


async def _bounded(self, head, commit_every: int, arrived: int, timeout: float, done, most=None) -> bool:  # noqa: ARG001
    """Handshake.settled_through before stop 56: ``timeout`` bounds the whole wait."""
    deadline = time.monotonic() + timeout
    while not self.through(head(), commit_every, arrived):
        left = deadline - time.monotonic()
        if left <= 0 or done.is_set():
            return False
        try:
            await asyncio.wait_for(self._wake.wait(), left)
        except TimeoutError:
            return False
    return True


def one_run(client, hostile: str, case: str, seed: int, max_epochs: int) -> dict:
    import robust

    import vcdask
    from vcdask.demo import accuracy_on, digits, digits_cnn

    (X, y), (Xt, yt) = digits(seed)
    merge = vcdask.merge.Nesterov(lr=0.5, momentum=0.9) if case == "nesterov" else "probe"
    screened = case == "screened"
    optimizer = functools.partial(robust.HostileAdam, lr=1e-3, hostile=(hostile,) if screened else (), mode="flip")
    t0 = time.perf_counter()
    with scratch_store(None, "merge-queue") as store:
        result = vcdask.fit(
            digits_cnn(seed),
            (X, y),
            optimizer=optimizer,
            merge=merge,
            resilience=vcdask.Resilience(max_norm_ratio=3.0, min_cosine=0.0) if screened else None,
            validation=0.1,
            max_epochs=max_epochs,
            n_shards=8,
            seed=seed,
            client=client,
            store=store,
            progress=False,
            retention=False,
        )
        seconds = time.perf_counter() - t0
        h = result.history
        merged = h[h.outcome == "merged"]
        return {
            "accuracy": accuracy_on(result.model, Xt, yt),
            "staleness": float(merged.staleness.median()),
            "largest": float(merged.staleness.max()),
            "too stale": int(h.reason.fillna("").str.contains("stale").sum()),
            "seconds": seconds,
        }


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    ap.add_argument("--busy", type=ints, default=[0, 2], help="busy-loop processes beside the runs (0,2)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"a comma list of {','.join(CASES)}")
    ap.add_argument("--wait", default=",".join(WAITS), help=f"a comma list of {','.join(WAITS)}")
    ap.add_argument("--seeds", type=ints, default=[0, 1, 2])
    ap.add_argument("--max-epochs", type=int, default=8)
    args = ap.parse_args(argv)
    cases, waits = args.cases.split(","), args.wait.split(",")
    for bad, allowed in ((set(cases) - set(CASES), CASES), (set(waits) - set(WAITS), WAITS)):
        if bad:
            ap.error(f"{sorted(bad)} not among {list(allowed)}")

    import dask.config
    from distributed import Client

    import vcdask.engine.handshake as handshake
    from vcdask.cluster import embedded_cluster

    progress = handshake.Handshake.settled_through
    rows = []
    with (
        dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}),
        embedded_cluster(n_workers=4) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        hostile = sorted(client.scheduler_info()["workers"])[0]
        for busy in args.busy:
            spinners = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(busy)]
            for p in spinners:
                p.start()
            try:
                for seed in args.seeds:  # (the waits and cases of a seed one after the other: paired)
                    for wait in waits:
                        handshake.Handshake.settled_through = progress if wait == "progress" else _bounded
                        for case in cases:
                            row = one_run(client, hostile, case, seed, args.max_epochs)
                            row.update(busy=busy, wait=wait, case=case, seed=seed)
                            log(f"busy {busy} wait {wait} {case} seed {seed}: " + ", ".join(
                                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in row.items() if k not in ("busy", "wait", "case", "seed")
                            ))  # fmt: skip
                            rows.append(row)
            finally:
                handshake.Handshake.settled_through = progress
                for p in spinners:
                    p.kill()
    print(f"\nruns of {args.max_epochs} epochs, 4 workers, 8 shards; seeds {args.seeds}; medians over the seeds\n")
    print("| busy loops | wait | case | test accuracy | by seed | staleness, median | largest | too stale | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for busy in args.busy:
        for wait in waits:
            for case in cases:
                group = [r for r in rows if (r["busy"], r["wait"], r["case"]) == (busy, wait, case)]
                med = functools.partial(_median, group)
                by_seed = " ".join(f"{r['accuracy']:.3f}" for r in group)
                print(
                    f"| {busy} | {wait} | {case} | {med('accuracy'):.3f} | {by_seed} | {med('staleness'):.1f} "
                    f"| {med('largest'):.0f} | {med('too stale'):.0f} | {med('seconds'):.1f} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
