"""What faults cost: the same run with no faults, with periodic worker kills, and with a straggler.

usage: python benchmarks/chaos.py [--epochs 12] [--kill-every 1.5] [--repeat 1]

digits, the demo CNN, 3 worker processes (embedded LocalCluster), alpha 0.5, 4 local epochs,
8 shards.  Faults are real: SIGKILL of a busy worker process (its nanny restarts it), and a
straggler made by SIGSTOP/SIGCONT of one worker (1 s stopped out of every 2 s, i.e. a machine
at half speed with long pauses).  Prints one table row per scenario.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import threading
import time

import dask
from _scratch import add_store_argument, scratch_store
from distributed import Client

import vcdask
from vcdask.cluster import embedded_cluster
from vcdask.demo import accuracy_on, digits, digits_cnn


def _busy(client) -> list[str]:
    return [a for a, keys in client.processing().items() if any(str(k).startswith("vcdask-train-") for k in keys)]


class Fault(threading.Thread):
    def __init__(self, client, kind: str, period: float, seed: int = 0):
        super().__init__(daemon=True)
        self.client, self.kind, self.period, self.rng = client, kind, period, random.Random(seed)
        self.halt = threading.Event()
        self.count = 0
        self.victim = None

    def run(self):
        if self.kind == "straggler":
            self.victim = sorted(self.client.sync(self.client.scheduler.identity, n_workers=-1)["workers"])[0]
            pid = self.client.run(os.getpid, workers=[self.victim])[self.victim]
            while not self.halt.is_set():
                os.kill(pid, signal.SIGSTOP)
                time.sleep(self.period / 2)
                os.kill(pid, signal.SIGCONT)
                self.count += 1
                self.halt.wait(self.period / 2)
            return
        while not self.halt.wait(self.period):
            try:
                busy = _busy(self.client)
                if busy:
                    victim = self.rng.choice(busy)
                    os.kill(self.client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
                    self.count += 1
            except Exception:  # noqa: BLE001 - the victim may be gone already
                continue

    def stop(self):
        self.halt.set()
        self.join(10)


def scenario(client, kind: str, args, data, seed: int, store: str) -> dict:
    (X, y), (Xt, yt) = data
    fault = Fault(client, kind, args.kill_every if kind == "kills" else 2.0, seed) if kind != "none" else None
    t0 = time.perf_counter()
    if fault:
        fault.start()
    try:
        r = vcdask.fit(
            digits_cnn(seed),
            (X, y),
            validation=0.1,
            max_epochs=args.epochs,
            n_shards=8,
            local_epochs=4,
            alpha=0.5,
            seed=seed,
            client=client,
            store=store,
            progress=False,
            resilience=vcdask.Resilience(deadline_floor=1.0, max_staleness=args.max_staleness),
        )
    finally:
        if fault:
            fault.stop()
    wall = time.perf_counter() - t0
    h = r.history
    reasons = h.reason.fillna("")
    reissued = int(h.groupby(["epoch", "shard"]).attempt.max().sum())
    rejected = reasons[reasons.str.contains("non-finite|layout|update norm|stale")]
    return {
        "faults": fault.count if fault else 0,
        "reissued": reissued,
        "late": int(reasons.str.startswith("late").sum()),
        "lost": int(reasons.str.startswith("lost").sum()),
        "rejected": len(rejected),
        "max_staleness_seen": int(h[h.accepted].staleness.max()),
        "wall": wall,
        "acc": accuracy_on(r.model, Xt, yt),
        "merged_once": int(h.accepted.sum()) == args.epochs * 8
        and not h[h.accepted].duplicated(["epoch", "shard"]).any(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--kill-every", type=float, default=1.5)
    ap.add_argument("--repeat", type=int, default=1)
    add_store_argument(ap)
    ap.add_argument(
        "--max-staleness",
        default="auto",
        type=lambda v: None if v == "none" else v if v == "auto" else int(v),
        help='an integer, "auto" (the default) or "none" (merge every update, as the paper does)',
    )
    args = ap.parse_args()
    data = digits()
    rows = {k: [] for k in ("none", "kills", "straggler")}
    # LocalCluster closes a nanny whose worker is still down 15 s after a death (lost-worker-timeout); with a
    # kill every 1.5 s that retires the pool one nanny at a time.  Here every nanny keeps restarting its worker.
    with scratch_store(args.store, "chaos") as store, dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"}):
        for seed in range(args.repeat):
            for kind in rows:
                with embedded_cluster(n_workers=3) as cluster, Client(cluster, set_as_default=False) as client:
                    rows[kind].append(scenario(client, kind, args, data, seed, store))
    base_wall = statistics.median(r["wall"] for r in rows["none"])
    base_acc = statistics.median(r["acc"] for r in rows["none"])
    print(
        f"\ndigits, demo CNN, 3 worker processes, {args.epochs} epochs x 8 shards, alpha 0.5; "
        f"max_staleness={args.max_staleness}; median of {args.repeat} run(s) per scenario\n"
    )
    print(
        "| scenario | faults | re-issued | late results discarded | lost with a worker | rejected "
        "| max staleness merged | wall (s) | overhead vs no faults | test accuracy | accuracy diff (points) "
        "| every shard merged once |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    labels = {
        "none": "no faults",
        "kills": f"SIGKILL a busy worker every {args.kill_every} s",
        "straggler": "straggler (SIGSTOP 1 s of every 2 s)",
    }
    for kind, runs in rows.items():
        med = {
            k: statistics.median(r[k] for r in runs)
            for k in ("faults", "reissued", "late", "lost", "rejected", "max_staleness_seen", "wall", "acc")
        }
        print(
            f"| {labels[kind]} | {med['faults']:.0f} | {med['reissued']:.0f} | {med['late']:.0f} | "
            f"{med['lost']:.0f} | {med['rejected']:.0f} | {med['max_staleness_seen']:.0f} | {med['wall']:.1f} | "
            f"{100 * (med['wall'] / base_wall - 1):+.0f}% | {med['acc']:.4f} | {100 * (med['acc'] - base_acc):+.2f} "
            f"| {all(r['merged_once'] for r in runs)} |"
        )


if __name__ == "__main__":
    main()
