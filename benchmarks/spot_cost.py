"""What a spot fleet saves: real runs on this machine under replayed preemption traces, priced.

usage: python benchmarks/spot_cost.py [--rates 0,5,20] [--notices 120,30] [--seeds 0,1] [--epochs 60]
                                      [--workers 2] [--discount 0.7] [--scale 1800]

Each row is a real ``vcdask.fit`` (digits, the demo CNN, an embedded LocalCluster of ``--workers``
processes) whose workers are "spot instances": a trace preempts them at ``rate`` per cent of the
instances per hour, each with a notice of ``notice`` seconds, and each reclaimed instance is replaced
by a new one, requested on the notice (AWS capacity rebalancing, GCP managed instance groups), that
comes up ``--replace`` seconds later.

Time is compressed: one second of run is ``--scale`` seconds of the trace (default 1800: a 13 s run
stands for 6.5 hours), so that these short runs see the preemptions a long job would.  Notices and
replacement delays are compressed the same way (120 s -> 0.07 s).

Each replacement is asked for ahead of its preemption by the time a new worker takes to join here
(forked from a process that has torch imported: ~1.7 s), so that it joins when a real fleet's would,
in compressed time.  Until stop 23 it was asked for on the notice and joined ~3 s of real time later
(1.5 hours of trace), which dominated every row.

The notice reaches the run through ``vcdask.preempt(client, worker, window=...)`` (what the
PreemptionWatcher sends), the replacement through ``cluster.scale``.  Cost comes from the run's own
accounting (``FitResult.cost``, ``vcdask.cloud.prices``): one instance type at on-demand price 1 and
spot price ``1 - discount`` per hour.  Against it: the same run with no preemptions, at on-demand
prices (``rate 0`` of the on-demand row).  Prints, per trace, median over seeds: preemptions, wall
time and its overhead against on-demand, the spot run's cost, the on-demand run's cost, the saving,
the work wasted, and test accuracy.  Cleans up its stores.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import threading
import time

import dask.config
from _args import number_list
from _scratch import scratch_store
from devices import markdown
from distributed import Client

import vcdask
from vcdask.cluster import embedded_cluster
from vcdask.demo import accuracy_on, digits, digits_cnn

TYPE = "bench.spot"


def _busy(client) -> list[str]:
    return [a for a, keys in client.processing().items() if any(str(k).startswith("vcdask-train-") for k in keys)]


class Trace(threading.Thread):
    """Preemptions as a Poisson process: ``rate`` per instance per hour, in compressed time.

    The preemption times are drawn up front, so each replacement can be asked for ``lead`` seconds
    before its preemption: the time a new worker process takes to join here (measured at start-up),
    less the compressed replacement delay.  It then joins when a real fleet's replacement would, in
    compressed time, instead of 1.5-3 s of uncompressed process start later.
    """

    def __init__(
        self, client, cluster, n: int, rate: float, notice: float, replace: float, scale: float, seed: int, lead: float
    ):
        super().__init__(daemon=True)
        self.client, self.cluster, self.n = client, cluster, n
        per_second = rate / 100 / 3600 * scale * n  # preemptions per second of run, fleet-wide
        rng = random.Random(seed)
        self.times: list[float] = []
        while per_second > 0 and (not self.times or self.times[-1] < 3600):
            self.times.append((self.times[-1] if self.times else 0.0) + rng.expovariate(per_second))
        self.notice = notice / scale
        self.lead = max(0.0, lead - replace / scale)
        self.rng = rng
        self.halt = threading.Event()
        self.count = 0

    def run(self):
        t0 = time.monotonic()
        pending = [(t - self.lead, "replace") for t in self.times] + [(t, "preempt") for t in self.times]
        for at, what in sorted(pending):
            if self.halt.wait(max(0.0, at - (time.monotonic() - t0))):
                return
            try:
                if what == "replace":  # (the reclaimed worker's entry stays in the spec, closed: one more entry)
                    self.cluster.scale(len(self.cluster.worker_spec) + 1)
                    continue
                victims = _busy(self.client) or sorted(
                    self.client.sync(self.client.scheduler.identity, n_workers=-1)["workers"]
                )
                if victims:
                    vcdask.preempt(self.client, self.rng.choice(victims), window=self.notice)
                    self.count += 1
            except Exception:  # noqa: BLE001 - the run or the cluster may be closing
                return


def join_seconds(cluster, client) -> float:
    """How long a new worker process takes to join here (then it is retired again)."""
    before = set(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
    t0 = time.perf_counter()
    cluster.scale(len(cluster.worker_spec) + 1)
    while len(client.sync(client.scheduler.identity, n_workers=-1)["workers"]) <= len(before):
        time.sleep(0.02)
    took = time.perf_counter() - t0
    new = set(client.sync(client.scheduler.identity, n_workers=-1)["workers"]) - before
    client.retire_workers(list(new), close_workers=True)
    cluster.scale(len(before))
    while len(client.sync(client.scheduler.identity, n_workers=-1)["workers"]) > len(before):
        time.sleep(0.02)
    return took


def one_run(args, market: str, rate: float, notice: float, seed: int, data) -> dict:
    (X, y), (Xt, yt) = data
    prices = {TYPE: {"on-demand": 1.0, "spot": 1.0 - args.discount}}
    here = {"vcdask.cloud.instance": {"type": TYPE, "market": market}, "vcdask.cloud.prices": prices}
    # new workers fork from a server that has torch and vcdask imported (an image with them baked in)
    here["distributed.worker.multiprocessing-method"] = "forkserver"
    multiprocessing.set_forkserver_preload(["torch", "vcdask.worker"])
    with dask.config.set(here), scratch_store(None, "spot") as store:
        with embedded_cluster(n_workers=args.workers) as cluster, Client(cluster, set_as_default=False) as client:
            lead = join_seconds(cluster, client) if rate > 0 else 0.0
            trace = Trace(client, cluster, args.workers, rate, notice, args.replace, args.scale, seed, lead)
            t0 = time.perf_counter()
            trace.start()
            try:
                result = vcdask.fit(
                    digits_cnn(seed),
                    (X, y),
                    max_epochs=args.epochs,
                    seed=seed,
                    client=client,
                    store=store,
                    progress=False,
                    retention=False,
                )
            finally:
                trace.halt.set()
            wall = time.perf_counter() - t0
            acc = accuracy_on(result.model, Xt, yt)
    return {
        "preemptions": trace.count,
        "wall": wall,
        "cost": result.cost["total"],
        "wasted": result.cost["wasted_seconds"],
        "workers seen": len(result.workers),
        "accuracy": acc,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="0,5,20", help="preemptions, per cent of the instances per hour")
    ap.add_argument("--notices", default="120,30", help="notice windows, seconds")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--discount", type=float, default=0.7, help="spot price below on-demand (the paper's 70%%)")
    ap.add_argument("--scale", type=float, default=1800.0, help="trace seconds per second of run")
    ap.add_argument("--replace", type=float, default=90.0, help="seconds from a notice to its replacement's start")
    args = ap.parse_args(argv)
    rates = number_list(ap, "--rates", args.rates, float, minimum=0)
    notices = number_list(ap, "--notices", args.notices, float, minimum=0)
    seeds = number_list(ap, "--seeds", args.seeds, int, minimum=0)
    if args.epochs < 1 or args.workers < 1:
        ap.error(f"--epochs and --workers must be >= 1, got {args.epochs} and {args.workers}")
    if not 0 <= args.discount < 1:
        ap.error(f"--discount must be in [0, 1), got {args.discount}")
    if not args.scale > 0 or not args.replace >= 0:
        ap.error(f"--scale must be > 0 and --replace >= 0, got {args.scale} and {args.replace}")
    data = digits()
    baseline = {s: one_run(args, "on-demand", 0.0, 0.0, s, data) for s in seeds}
    base_wall = statistics.median(b["wall"] for b in baseline.values())
    base_cost = statistics.median(b["cost"] for b in baseline.values())
    rows = [
        {
            "fleet": "on-demand",
            "rate %/h": 0.0,
            "notice s": "-",
            "preemptions": 0.0,
            "wall s": base_wall,
            "overhead %": 0.0,
            "cost $ (x1e3)": 1e3 * base_cost,
            "saving %": 0.0,
            "wasted s": statistics.median(b["wasted"] for b in baseline.values()),
            "accuracy": statistics.median(b["accuracy"] for b in baseline.values()),
        }
    ]
    for rate in rates:
        for notice in notices if rate > 0 else [0.0]:
            runs = [one_run(args, "spot", rate, notice, s, data) for s in seeds]
            wall = statistics.median(r["wall"] for r in runs)
            cost = statistics.median(r["cost"] for r in runs)
            rows.append(
                {
                    "fleet": "spot",
                    "rate %/h": rate,
                    "notice s": f"{notice:g}" if rate > 0 else "-",
                    "preemptions": statistics.median(r["preemptions"] for r in runs),
                    "wall s": wall,
                    "overhead %": 100 * (wall / base_wall - 1),
                    "cost $ (x1e3)": 1e3 * cost,
                    "saving %": 100 * (1 - cost / base_cost),
                    "wasted s": statistics.median(r["wasted"] for r in runs),
                    "accuracy": statistics.median(r["accuracy"] for r in runs),
                }
            )
            print(rows[-1], flush=True)
    print(
        f"\ndigits, {args.epochs} epochs, {args.workers} workers, seeds {seeds}; spot {100 * args.discount:g}% "
        f"below on-demand; 1 s of run = {args.scale:g} s of trace; replacement after {args.replace:g} s"
    )
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
